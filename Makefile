# megaformer: make install | make test | make demo (see README.md)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# DeepSpeed JIT-compiles an op on first use; keep it between runs.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
# Install the local CPU build of torch first: an unpinned torch pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install test test-fast clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e ".[dev,ref]"
	touch $@

test: install
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) .cache build *.egg-info
