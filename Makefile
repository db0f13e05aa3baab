# The two set-up commands of README.md. Each makes (or reuses) a local virtual environment.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test test-slow test-all lint clean

$(BIN)/hethub: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The package accepts any torch in its range (vendor builds); constraints.txt pins this project's own
	# machines to the exact CPU wheel, never a CUDA build.
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $@

demo: $(BIN)/hethub
	$(BIN)/hethub demo

lint: $(BIN)/hethub
	$(BIN)/ruff check src tests bench

# Two workers: the suite is mostly single-threaded, and the CI machine has two cores. loadgroup: tests
# marked with one xdist_group share a worker (and so a search cached in tests/conftest.py, which also
# writes the group where pytest 9.2 reads it). `test` is the fast tier (target ~4 min idle; figures in
# docs/testing.md); the slow tier (tests/slow_tests.txt and @pytest.mark.slow) is
# `test-slow`; `test-all` (what .ci/run runs) is both.
PYTEST := $(BIN)/python -m pytest -q -n 2 --dist loadgroup

test: lint
	$(PYTEST) -m "not slow"

test-slow: $(BIN)/hethub
	$(PYTEST) -m slow

test-all: test test-slow

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache runs
