# gpudiag: two commands from a fresh clone.
#   make demo   the main job on this machine (falls back to a shipped capture without a GPU)
#   make test   lint, type checks and the whole test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
EXAMPLE := diag/examples/seed_8gpu_topo.txt
TYPED  := diag/hw diag/topology diag/render diag/cli.py diag/errors.py diag/findings.py diag/fileio.py

.PHONY: demo test lint typecheck pytest bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	@$(BIN)/gpudiag topology || { status=$$?; [ $$status -eq 3 ] || exit $$status; \
	  echo; echo "No NVIDIA driver here: showing the example capture $(EXAMPLE) instead."; echo; \
	  $(BIN)/gpudiag topology --from-file $(EXAMPLE); }

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy $(TYPED)

pytest: $(STAMP)
	$(BIN)/pytest -q

test: lint typecheck pytest

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
