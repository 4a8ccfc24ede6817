# megaformer: make install | make test | make demo (see README.md)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# DeepSpeed JIT-compiles an op on first use; keep it between runs.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
# Install the local CPU build of torch first: an unpinned torch pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

# make multi30k DATA=../shared/data/multi30k: prepare, train <= 60 min, average, evaluate en->de.
DATA ?= ../shared/data/multi30k
M30K := runs/multi30k
# bf16 where the CPU computes it natively (AVX512-BF16 / AMX), fp32 elsewhere.
M30K_PRECISION ?= $(shell grep -qsE 'avx512_bf16|amx_bf16' /proc/cpuinfo && echo bf16 || echo fp32)

.PHONY: install lint test demo multi30k clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e ".[dev,ref,hf]"
	touch $@

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The two-node SLURM cluster tests first, on a quiet machine: their requeue and signal timings are
# real (SLURM's, the kernel's), not simulated.
test: install lint
	$(PY) -m pytest -q tests/test_slurm_cluster.py
	$(PY) -m pytest -q tests --ignore=tests/test_slurm_cluster.py

demo: install
	$(PY) -m megaformer.demo

multi30k: install
	$(PY) -m megaformer.cli prepare --src en --tgt de --train $(DATA)/train --valid $(DATA)/val \
		--test $(DATA)/test_2016_flickr --vocab-size 8000 --out $(M30K)/data --force
	$(PY) -m megaformer.cli train --config configs/multi30k.yaml --set data.path=$(M30K)/data \
		--set train.precision=$(M30K_PRECISION) --set train.zero_stage=$(if $(filter fp32,$(M30K_PRECISION)),0,1) \
		--run-dir $(M30K)/run --nproc 2 --resume auto
	$(PY) -m megaformer.cli average --last 5 --run-dir $(M30K)/run --out $(M30K)/averaged.pt
	$(PY) -m megaformer.cli evaluate --ckpt $(M30K)/averaged.pt --input $(M30K)/data/test.en \
		--ref $(M30K)/data/test.de --output $(M30K)/test.hyp

clean:
	rm -rf $(VENV) .cache build *.egg-info
