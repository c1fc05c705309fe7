# gpudiag: two commands from a fresh clone.
#   make demo   gpudiag without the test extras, then two doctors: this machine (every check
#               that applies here) and the seed machine's capture with its broken link planted
#               (a real finding: the NVLink pair trains, the PCIe pair goes NaN)
#   make test   lint, type checks and the whole test suite
#   make fuzz   the property tests with new random examples, seed after seed, for FUZZ_MINUTES
#               (make test runs them derandomised: the same examples every time); a failure
#               prints its seed, and make fuzz SEED=n runs that seed again
#   make test-floor  lint, type checks and the whole test suite on the oldest torch/torchvision
#                  pyproject.toml admits (its floor), in .venv-floor
#   make gpu-test  on a machine that already has torch and a GPU (no network needed): install
#                  gpudiag into $(PYTHON), run the whole suite with the gpu tests (gpu-suite), then
#                  gradcheck torchvision models at world size 1 on CUDA (gpu-gradcheck); each part
#                  alone installs first (docs/gpu-validation.md)
#   make screenshots  the docs' pictures (docs/images/*.svg, *.png) drawn from real inputs and
#                  screenshotted with a doctor bundle's REPORT.html in headless Chromium; installs
#                  nothing: needs .venv (make test) and Chromium (Debian: apt-get install chromium)
#   make gpu-bench on the same kind of machine: the speed targets measured on CUDA
#                  (bench, watch and runtime overheads, bench's accuracy, a one-node sweep)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TYPED  := diag checks repro

#: pyproject.toml's floor (torch>=, torchvision>=) pinned: the versions test-floor proves
FLOOR      := .venv-floor
FLOOR_PINS := torch==2.11.0 torchvision==0.26.0

#: each gradcheck and gpu-bench measurement stops after this many seconds (a device lease
#: runs 10 minutes per command); PYTEST_ARGS narrows gpu-suite, e.g. to half of the files
GPU_STEP_S  ?= 300
PYTEST_ARGS ?=

#: the commit gpu-test names; give it where the copy has no .git: make gpu-test COMMIT=abc1234
COMMIT ?= $(shell git rev-parse --short HEAD 2>/dev/null)

#: gradcheck'd on CUDA by gpu-test (world size 1: every strategy must agree with single).
GPU_MODELS := resnet18 resnet50 mobilenet_v3_small convnext_tiny densenet121

#: make fuzz: how long to draw, examples per property test per seed, a seed to rerun
FUZZ_MINUTES  ?= 10
FUZZ_EXAMPLES ?= 1000
SEED          ?=

CHROMIUM ?= chromium

.PHONY: screenshots fuzz demo test test-floor gpu-install gpu-suite gpu-gradcheck gpu-test gpu-bench lint typecheck pytest bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

#: make demo installs gpudiag and what it needs to run, not the test extras (make test adds them)
DEMO_STAMP := $(VENV)/.installed-demo

$(DEMO_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e .
	touch $@

demo: $(DEMO_STAMP)
	@echo "== gpudiag doctor   (this machine)"
	$(BIN)/gpudiag doctor
	@echo
	@echo "== the seed machine: its capture, the fault of its PCIe link planted (exit 1: a finding)"
	$(BIN)/gpudiag doctor --machine diag/examples/seed_8gpu_topo.txt --inject '5->6:nan@3' --pairs 4-5,5-6 \
	  --checks topology,nancheck \
	  || [ $$? -eq 1 ]

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy $(TYPED)

pytest: $(STAMP)
	$(BIN)/pytest -q

test: lint typecheck pytest

fuzz: $(STAMP)
	@end=$$(( $$(date +%s) + $(FUZZ_MINUTES) * 60 )); seed="$(SEED)"; \
	while :; do \
	  [ -n "$$seed" ] || seed=$$(od -An -N4 -tu4 /dev/urandom | tr -d ' '); \
	  echo "== make fuzz: seed $$seed, $(FUZZ_EXAMPLES) examples per property"; \
	  GPUDIAG_HYPOTHESIS_PROFILE=fuzz FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/pytest -q -p no:cacheprovider \
	    -m "hypothesis and not slow" --hypothesis-seed=$$seed \
	    || { echo "make fuzz: a property failed with seed $$seed; rerun it: make fuzz SEED=$$seed"; exit 1; }; \
	  [ -z "$(SEED)" ] && [ $$(date +%s) -lt $$end ] || break; seed=""; \
	done

screenshots:
	@test -x $(BIN)/python || { echo "make screenshots: no $(VENV) here; make test (or make pytest) creates it"; exit 3; }
	@command -v $(CHROMIUM) >/dev/null || { echo "make screenshots: no $(CHROMIUM) here; install Chromium (Debian: apt-get install chromium) or give CHROMIUM=/path/to/it"; exit 3; }
	$(BIN)/python docs/images/screenshots.py --chromium $(CHROMIUM) --out docs/images

$(FLOOR)/.installed: pyproject.toml
	$(PYTHON) -m venv $(FLOOR)
	$(FLOOR)/bin/pip install --quiet --disable-pip-version-check -e '.[test]' $(FLOOR_PINS)
	touch $@

test-floor: $(FLOOR)/.installed
	$(FLOOR)/bin/python -c 'import torch, torchvision; print("test-floor: torch", torch.__version__, "torchvision", torchvision.__version__)'
	$(FLOOR)/bin/ruff check .
	$(FLOOR)/bin/ruff format --check .
	$(FLOOR)/bin/mypy $(TYPED)
	$(FLOOR)/bin/pytest -q

gpu-install:
	$(PYTHON) -m pip install --quiet --no-deps --no-build-isolation .
	@$(PYTHON) -c 'import datetime, platform, sys, torch, torchvision; \
	  n = torch.cuda.device_count() if torch.cuda.is_available() else 0; \
	  commit = "$(COMMIT)" or "unknown"; \
	  print(f"gpu-test {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit}, " \
	        f"{platform.node()}: torch {torch.__version__} (CUDA {torch.version.cuda}), torchvision {torchvision.__version__}, " \
	        f"python {platform.python_version()}"); \
	  [print(f"  GPU {i}: {torch.cuda.get_device_name(i)}") for i in range(n)]; \
	  sys.exit(0 if n else "gpu-test: no CUDA GPU here")'

gpu-suite: gpu-install
	$(PYTHON) -m pytest -q -rs -p no:cacheprovider --durations=10 $(PYTEST_ARGS)

gpu-gradcheck: gpu-install
	@for model in $(GPU_MODELS); do \
	  echo "== gpudiag gradcheck --model torchvision:$$model?num_classes=10 --world-size 1"; \
	  timeout $(GPU_STEP_S) $(PYTHON) -m gpudiag gradcheck --model "torchvision:$$model?num_classes=10" \
	    --input-shape 3,32,32 --world-size 1 || exit 1; \
	done

gpu-test: gpu-suite gpu-gradcheck

#: Each measurement under its own time limit; one that fails or runs out is named at the
#: end and the others still run.
gpu-bench: gpu-install
	@failed=""; \
	for step in \
	  "$(PYTHON) -m gpudiag bench --model 'torchvision:resnet18?num_classes=10' --data loader:4 --steps 30" \
	  "$(PYTHON) bench/bench_accuracy.py --rounds 5" \
	  "$(PYTHON) bench/runtime_overhead.py --device cuda --steps 100 --warmup 10" \
	  "$(PYTHON) bench/watch_overhead.py --device cuda" \
	  "$(PYTHON) -m torch.distributed.run --standalone --nproc-per-node 1 -m gpudiag sweep --quick \
	     -o $${TMPDIR:-/tmp}/gpudiag-gpu-sweep --force"; do \
	  echo "== $$step"; \
	  timeout $(GPU_STEP_S) sh -c "$$step" || failed="$$failed$$(printf '\n  %s' "$$step")"; \
	done; \
	if [ -n "$$failed" ]; then echo "gpu-bench: failed or out of time ($(GPU_STEP_S) s each):$$failed"; exit 1; fi

clean:
	rm -rf $(VENV) $(FLOOR) .pytest_cache .mypy_cache .ruff_cache .hypothesis
