# gpudiag: two commands from a fresh clone.
#   make demo   gpudiag doctor: every check that applies here, a summary, a report bundle
#   make test   lint, type checks and the whole test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TYPED  := diag/hw diag/topology diag/render diag/cli.py diag/errors.py diag/findings.py diag/fileio.py \
          diag/runtime/numerics.py diag/runtime/launch.py diag/runtime/rank_process.py

.PHONY: demo test lint typecheck pytest bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/gpudiag doctor --output demo-report --force

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
