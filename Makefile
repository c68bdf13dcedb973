# Two commands do all setup on a fresh machine: `make demo` and `make test`.
# Both create .venv when missing and install torch 2.13.0 plus dtorch (editable).
# Plain `pip install torch` takes the wheel your pip finds first: on Linux x86_64 PyPI's is the
# CUDA build. For the CPU build elsewhere, point pip at PyTorch's CPU wheel index:
#   make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.dtorch-installed
TORCH_PIN ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: setup demo test bench kernel clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
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
