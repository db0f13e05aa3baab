# The two set-up commands of README.md. Each makes (or reuses) a local virtual environment.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint clean

$(BIN)/hethub: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch is pinned ==2.13.0 in pyproject.toml: the CPU wheel on this machine, never a CUDA build.
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

demo: $(BIN)/hethub
	$(BIN)/hethub demo

lint: $(BIN)/hethub
	$(BIN)/ruff check src tests bench

# Two workers: the suite is mostly single-threaded, and the CI machine has two cores. loadgroup: tests
# marked with one xdist_group share a worker (and so a search cached in tests/conftest.py).
test: lint
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache runs
