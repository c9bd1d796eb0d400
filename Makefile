# Quick start: `make test` (set-up + the whole suite), `make demo` (set-up + the embedded default run).
# Python 3.12 (megatron-core >= 0.17 needs it): `python3.12` on PATH, else pyenv's 3.12, else set PYTHON=...
PYTHON ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do \
            $$p -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1 && { echo $$p; break; }; done)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup lint test test-fast demo gpu-acceptance clean

setup: $(STAMP)

# Re-installs only when the lock file or pyproject.toml changed (the stamp is newer otherwise). A .venv of
# another Python version (an older checkout's) is replaced.
$(STAMP): requirements-lock.txt requirements-nodeps.txt pyproject.toml
	@test -n "$(PYTHON)" || { echo "ERROR: Python 3.12 not found; install it or run make PYTHON=/path/to/python3.12"; exit 1; }
	@if test -x $(PY) && ! $(PY) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then \
	    echo "$(VENV) is not Python 3.12: recreating it"; rm -rf $(VENV); fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-lock.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-nodeps.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	@if $(PY) -c "import apex" 2>/dev/null; then echo "ERROR: a module named 'apex' is importable in $(VENV); uninstall it (Megatron would pick it up on CPU)"; exit 1; fi
	touch $(STAMP)

# ruff, configured in pyproject.toml (pycodestyle errors, pyflakes, import order, line length 120)
lint: setup
	$(VENV)/bin/ruff check .

# The suite runs on TEST_WORKERS processes (pytest-xdist). tests/conftest.py schedules the work: a module's tests on
# one worker, the modules of the shared 4-rank launch together, the longest first. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2

test: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --durations=25 tests

# Everything except the tests marked `slow` (CI runs them all through `make test`).
test-fast: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not slow" tests

demo: setup
	$(PY) pretrain_gpt.py --residual delta_block

# One GPU, at most 6 minutes: the CUDA tests (tests/gpu) and the throughput run; results under OUT (docs/gpu.md).
gpu-acceptance:
	tools/gpu_acceptance.sh $(OUT)

clean:
	rm -rf $(VENV) runs .pytest_cache
