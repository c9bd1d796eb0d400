# Quick start: `make test` (set-up + the whole suite), `make demo` (set-up + the embedded default run).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test test-fast demo clean

setup: $(STAMP)

# Re-installs only when the lock file or setup.py changed (the stamp is newer otherwise).
$(STAMP): requirements-lock.txt requirements-nodeps.txt setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-lock.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-nodeps.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	@if $(PY) -c "import apex" 2>/dev/null; then echo "ERROR: a module named 'apex' is importable in $(VENV); uninstall it (Megatron would pick it up on CPU)"; exit 1; fi
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q tests

# Everything except the tests marked `slow` (CI runs them all through `make test`).
test-fast: setup
	$(PY) -m pytest -q -m "not slow" tests

demo: setup
	$(PY) pretrain_gpt.py --residual delta_block

clean:
	rm -rf $(VENV) runs .pytest_cache
