# megaformer: make install | make test | make demo (see README.md)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Install the local CPU build of torch first: an unpinned torch pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

# make multi30k [DATA=../shared/data/multi30k] [MINUTES=60] [TESTS="test_2016_flickr ..."]: prepare, train for
# MINUTES, average the last 5, score each test set. The settings for the machine are chosen by
# megaformer/recipes/multi30k.py (`megaformer multi30k --dry-run` prints them); M30K_GPUS=0 trains on the CPU
# where nvidia-smi lists a GPU, M30K_PRECISION=fp32|bf16 overrides the precision.
DATA ?= ../shared/data/multi30k
MINUTES ?= 60
TESTS ?= test_2016_flickr
M30K_GPUS ?=
M30K_PRECISION ?=

.PHONY: install lint test check fake-cuda demo multi30k wmt14 clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e ".[dev,ref,hf]"
	touch $@

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The suite in TEST_WORKERS pytest-xdist workers (2 to 8, by the cores), each taking whole files
# (--dist loadfile: a file's shared runs and the SLURM cluster are built once), the longest files
# first (tests/conftest.py; --no-loadscope-reorder, or xdist starts the files with the most tests
# first and the SLURM cluster's minutes, much of them waiting on slurmctld, end the run alone).
# On 2 cores the serial suite left a core idle a quarter of the time
# (process start-up, SLURM's scheduling waits); two workers fill it: 13 min 30 s against 17 min.
# A third worker there (2026-12-06, cold compile cache) left the cores idle 4.7 % of the time
# against 7.5 %, and the suite took 14 min 13 s against 15 min 0 s: not worth a third process's
# contention in the tests that wait on time (SLURM's, the launcher's).
TEST_WORKERS ?= $(shell n=$$(nproc); echo $$(( n < 2 ? 2 : (n > 8 ? 8 : n) )))
test: install lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# The inner loop: lint and the tests that need no training run, cluster or compiler (under 2 minutes on 2 cores).
CHECK_TESTS := test_house test_config test_layout test_batching test_rng test_model test_data_corpus \
	test_data_synthetic test_feed test_state_round_trip test_cpu_backend test_device_path test_decode_search test_cli_inputs \
	test_cli_outputs test_protect_inputs test_checkpoint
check: install lint
	$(PY) -m pytest -q -x $(foreach t,$(CHECK_TESTS),tests/$(t).py)

# make fake-cuda: tests/test_fake_cuda.py (skipped by `make test`) in CUDA_VENV, with the CUDA build of the same
# torch and megaformer: its step, validation, decoding and checkpoints with tensors on cuda:0 in name only (no GPU or
# driver needed), failing on a CPU tensor mixed in. The first install downloads ~4.7 GB (pip's cache keeps it); pip
# runs --isolated, as this machine's pip config prefers the local CPU wheel.
CUDA_VENV ?= .venv-cuda
CUDA_PIP = $(CUDA_VENV)/bin/pip install --isolated --quiet --disable-pip-version-check $(addprefix --cert ,$(wildcard /etc/ssl/certs/ca-certificates.crt))
# What the test imports of setup.py's install_requires (not DeepSpeed or tensorboard), and pytest.
CUDA_DEPS := numpy "sentencepiece>=0.2" "sacrebleu>=2.4" "pyyaml>=6" "webdataset>=0.2.90" "pytest>=8"

$(CUDA_VENV)/.installed: setup.py
	$(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_PIP) $(TORCH_SPEC)
	$(CUDA_PIP) --no-deps -e .
	$(CUDA_PIP) $(CUDA_DEPS)
	$(CUDA_VENV)/bin/python -c "import torch; torch.version.cuda or exit('$(CUDA_VENV): torch ' + torch.__version__ + ' has no CUDA')"
	touch $@

fake-cuda: $(CUDA_VENV)/.installed
	$(CUDA_VENV)/bin/python -m pytest -q tests/test_fake_cuda.py

demo: install
	$(PY) -m megaformer.commands.demo

multi30k: install
	$(PY) -m megaformer.cli multi30k --data '$(DATA)' --minutes '$(MINUTES)' --tests '$(TESTS)' \
		$(if $(M30K_GPUS),--gpus '$(M30K_GPUS)') $(if $(M30K_PRECISION),--precision '$(M30K_PRECISION)')

# make wmt14 RAW=DIR: WMT'14 en-de as downloaded (DIR holds training-parallel-europarl-v7.tgz,
# training-parallel-commoncrawl.tgz, training-parallel-nc-v9.tgz, dev.tgz, test-full.tgz) -> prepare (37,000
# shared pieces) -> train the big model through slurm/train_big.sh where SLURM answers (else WMT14_NPROC local
# processes) -> average the last 20 -> sacreBLEU and the paper's tokenized BLEU on newstest2014. The choices are
# megaformer/recipes/wmt14.py's; this only passes arguments. Tiny, on a CPU: WMT14_CONFIG=configs/tiny.yaml
# WMT14_VOCAB=300 WMT14_SET="train.max_steps=60 ..." WMT14_LAUNCH=local WMT14_NPROC=2 (tests/test_wmt14_recipe.py).
WMT14_WORK ?= runs/wmt14
WMT14_CONFIG ?= configs/transformer_big.yaml
WMT14_VOCAB ?= 37000
WMT14_SET ?=
WMT14_LAUNCH ?= auto
WMT14_SBATCH ?= sbatch
WMT14_SBATCH_ARGS ?=
WMT14_NPROC ?= $(or $(filter-out 0,$(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU ')),1)
WMT14_AVERAGE ?=

wmt14: install
	$(if $(RAW),,$(error RAW is empty: set RAW to the folder holding WMT'14's downloads (see the Makefile's wmt14 lines)))
	$(PY) -m megaformer.cli wmt14 --raw '$(RAW)' --work '$(WMT14_WORK)' --config '$(WMT14_CONFIG)' \
		--vocab-size '$(WMT14_VOCAB)' --launch '$(WMT14_LAUNCH)' --sbatch '$(WMT14_SBATCH)' \
		--sbatch-args '$(WMT14_SBATCH_ARGS)' --nproc '$(WMT14_NPROC)' $(addprefix --set ,$(WMT14_SET)) \
		$(if $(WMT14_AVERAGE),--average '$(WMT14_AVERAGE)')

clean:
	rm -rf $(VENV) .cache build *.egg-info
