# Two commands do all setup on a fresh machine: `make demo` and `make test`.
# Both create .venv when missing and install the CPU build of torch 2.13.0 plus dtorch (editable).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.dtorch-installed
TORCH_PIN ?= torch==2.13.0

.PHONY: setup demo test bench kernel clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

kernel: $(STAMP)
	$(BIN)/python -m dtorch_kernel install --sys-prefix

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis dask-scratch-space
