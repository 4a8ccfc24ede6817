# megaformer: make install | make test | make demo (see README.md)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Install the local CPU build of torch first: an unpinned torch pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

# make multi30k DATA=../shared/data/multi30k [MINUTES=15] [TESTS=...]: prepare, train <= MINUTES (default 60)
# min, average, evaluate en->de on each test set in TESTS. A run of other than 60 minutes has its own run dir,
# averaged model and hypotheses (runs/multi30k/run-15m, averaged-15m.pt, test_2016_flickr-15m.hyp), so it
# never resumes the 60-minute one.
DATA ?= ../shared/data/multi30k
MINUTES ?= 60
# MINUTES is checked before anything uses it: awk reads "abc" as 0 (0 is no time limit) and "" as a syntax error.
ifneq ($(filter multi30k,$(MAKECMDGOALS)),)
ifeq ($(shell echo '$(MINUTES)' | grep -Eqx '[0-9]*\.?[0-9]+' && awk 'BEGIN { exit !($(MINUTES) > 0) }' && echo ok),)
$(error MINUTES=$(MINUTES): the training minutes, a number above 0 (e.g. MINUTES=15))
endif
endif
# Test sets in DATA (NAME.en and NAME.de, plain or .gz), each scored once at the end; the first is also
# prepared with the data. Multi30k's task 1 has test_2017_flickr, test_2017_mscoco and test_2018_flickr too.
TESTS ?= test_2016_flickr
M30K := runs/multi30k
M30K_TAG := $(if $(filter 60,$(MINUTES)),,-$(MINUTES)m)
M30K_RUN := $(M30K)/run$(M30K_TAG)
# A side of a test set, plain or gzip: $(call m30k_side,NAME,LANG); empty where DATA has neither.
m30k_side = $(firstword $(wildcard $(DATA)/$(1).$(2) $(DATA)/$(1).$(2).gz))
# Scoring one test set, NAME, with the averaged model: $(call m30k_score,NAME).
define m30k_score
	@echo "multi30k: scoring $(1)"
	$(PY) -m megaformer.cli evaluate --ckpt $(M30K)/averaged$(M30K_TAG).pt --input $(call m30k_side,$(1),en) \
		--ref $(call m30k_side,$(1),de) --output $(M30K)/$(1)$(M30K_TAG).hyp

endef
M30K_MISSING := $(strip $(foreach t,$(TESTS),$(foreach l,en de,$(if $(call m30k_side,$(t),$(l)),,$(t).$(l)))))
# A side present both plain and gzip is refused, as prepare refuses it: the two may hold different text.
M30K_BOTH := $(strip $(foreach t,$(TESTS),$(foreach l,en de,$(if $(word 2,$(wildcard $(DATA)/$(t).$(l) $(DATA)/$(t).$(l).gz)),$(t).$(l)))))
# A checkpoint every MINUTES/24 minutes: the last 5, averaged, span the last ~20 % of any run length.
M30K_SAVE := $(shell awk 'BEGIN { print $(MINUTES) / 24 }')
# A machine with a CUDA GPU (nvidia-smi lists one) trains on one GPU, in one process, one micro-batch a
# step, in bf16 with the layers compiled (train.compile=auto), with the torch of $(VENV) (a CPU build there is
# refused before anything runs, naming M30K_GPUS=0); MINUTES=5 is its short run. Not yet measured
# on a GPU: docs/results.md says what has been. Set M30K_GPUS=0 to train on the CPU instead.
M30K_GPUS ?= $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
M30K_ON_GPU := $(filter-out 0,$(M30K_GPUS))
# bf16 on a GPU and where the CPU computes it natively (AVX512-BF16 / AMX), fp32 elsewhere.
M30K_PRECISION ?= $(if $(M30K_ON_GPU),bf16,$(shell grep -qsE 'avx512_bf16|amx_bf16' /proc/cpuinfo && echo bf16 || echo fp32))
# Dropout for the steps the run will reach: 0.25 overfits less from ~3,600 steps on, 0.15 learns faster
# below that. Two cores reach ~125 steps a minute in bf16 (AMX; ~90 on a slower Xeon with AMX, whose hour
# reached 5,422) and ~45 in fp32 (AVX2; steps of 3,000 tokens: an AVX2-only EPYC, natively, trained 1,915 of
# the fp32 recipes' 1,000 in 15 minutes), so a 60-minute fp32 run (2,533 measured) takes 0.15, as a
# 15-minute bf16 one (1,300-2,000 steps) does; a GPU is taken to reach ~2,000 a minute (the CPU hour's
# ~9,000 steps within minutes; not yet measured), so it keeps 0.25.
# Under 1,000 steps (a 15-minute fp32 run) 0.1, with the short recipe below.
M30K_RATE := $(if $(M30K_ON_GPU),2000,$(if $(filter bf16,$(M30K_PRECISION)),125,45))
M30K_STEPS := $(shell awk 'BEGIN { print $(MINUTES) * $(M30K_RATE) }')
M30K_SHORT := $(shell awk 'BEGIN { print ($(M30K_STEPS) < 1000) ? "yes" : "" }')
M30K_DROPOUT := $(if $(M30K_SHORT),0.1,$(shell awk 'BEGIN { print ($(M30K_STEPS) < 3600) ? 0.15 : 0.25 }'))
# A run expected to reach under 1,000 steps of 3,000 tokens (a short fp32 run) learns fastest from steps of 1,000
# tokens, dropout 0.1 and pre-LN layers (model.norm=pre) warmed up to a peak lr of 2.2e-3 (lr_scale 0.704). Post-LN
# at equal tokens (1.05M, ~an AVX2-only EPYC's 12 minutes): valid BLEU 24.02 at 1.1e-3 against 15.40 for the
# 60-minute settings at 1,500-token steps (docs/results.md, 2026-12-04). 1,000 steps of 1,000 tokens, the last 5
# averaged, valid: pre-LN 27.46 at 2.2e-3, 26.50 at 1.1e-3, 17.27 at 3.3e-3; post-LN at 1.1e-3 21.89, and 21.07 with
# the lr ramped to 0 over the last 30 %; another seed: pre-LN 27.82, post-LN 23.84 (2026-12-05 (fp32)). Marian
# has no pre-LN layers: this model exports to CTranslate2, safetensors and .pt, not to Hugging Face (megaformer
# export says so in one line).
# A longer fp32 run (60 minutes on an AVX2-only CPU: ~1,550 steps of 3,000 tokens) takes steps of 1,000 tokens
# too, with dropout 0.15: in an AVX2-only CPU's hour, emulated, valid 37.18 against 36.68 for steps of 1,500 and
# 36.31 for 3,000 at 1.6e-3 (post-LN, docs/results.md, 2026-12-05). bf16 and GPU runs keep 3,000 tokens and 1.6e-3.
# Such a run (~5,000 steps) also warms up longer, over a fifth of its steps up to 1,000 instead of 400 (post-LN at
# 1.1e-3: valid 38.27 against 36.53, 2026-12-05 (later)), and trains pre-LN layers to a peak of 2.2e-3
# (lr_scale 1.1132 at warmup_steps 1000), as the short run does. Exactly 4,930 steps (an AVX2-only EPYC's hour),
# the last 5 averaged, valid: pre-LN at 2.2e-3 39.75, at 1.1e-3 38.46, post-LN at 1.1e-3 38.51 (one run each,
# 2026-12-05 (hour)); test 37.93 (the post-LN recipe averaged to the same step: 36.99).
M30K_SMALL_STEPS := $(or $(M30K_SHORT),$(filter fp32,$(M30K_PRECISION)))
M30K_LONG_FP32 := $(if $(M30K_SHORT),,$(filter fp32,$(M30K_PRECISION)))
# A bf16 run on a CPU expected to reach under 3,600 steps (MINUTES=15: 1,300-2,000) would end on the inverse-sqrt
# decay at ~half its peak lr: it ramps the lr linearly to 0 over the last 30 % of its time (train.cooldown_fraction)
# and warms up to 2.4e-3 (lr_scale 0.768) instead of 1.6e-3. 15 minutes on a slower AMX Xeon (1,300-1,530 steps),
# valid, last 5 averaged: 37.07 and 35.55 (two seeds) against 34.80 without either; the ramp alone 36.10, over
# the last half 34.63; a third run, from a fresh clone, 33.89 at 1,348 steps: the spread between runs is as large
# (docs/results.md, 2026-12-05 (night)). The hour (averaging did what the ramp does, 2026-12-02), fp32 runs (not
# tried) and GPU runs keep the plain decay.
M30K_COOL := $(if $(M30K_ON_GPU),,$(if $(filter bf16,$(M30K_PRECISION)),$(shell awk 'BEGIN { print ($(M30K_STEPS) < 3600) ? "yes" : "" }')))
M30K_COOLDOWN := $(if $(M30K_COOL),0.3,0)
M30K_TOKENS := $(if $(M30K_SMALL_STEPS),1000,3000)
M30K_LR_SCALE := $(if $(M30K_LONG_FP32),1.1132,$(if $(M30K_SHORT),0.704,$(if $(M30K_COOL),0.768,0.512)))
M30K_NORM := $(if $(M30K_SMALL_STEPS),pre,post)
M30K_WARMUP := $(if $(M30K_LONG_FP32),1000,400)
# Two data-parallel ranks of one thread on a 2-core CPU: they split the validation decoding. One process of 2
# threads trained fp32 steps of 1,000 tokens 1.10x as fast in benchmarks/cpu_processes.py (AVX2 kernels), but
# reached only 1.03x the steps in an emulated AVX2-only hour (it decodes validations alone), valid 36.81 against
# 37.18; bf16's 3,000-token steps measured the same within noise (docs/results.md, 2026-12-05, 2026-12-03).
# On a GPU machine the venv's torch must see it (a CPU build there is refused in one line, before anything runs).
M30K_CUDA_CHECK = @$(PY) -c "import sys, torch; torch.cuda.is_available() or sys.exit('make multi30k: nvidia-smi lists \
	a GPU, but the torch in $(VENV) (' + torch.__version__ + ') sees none: install a CUDA build of torch there, or \
	set M30K_GPUS=0 to train on the CPU')"
M30K_LAYOUT := $(if $(M30K_ON_GPU),--nproc 1 --set parallel.device=cuda --set data.max_tokens=3072 --set data.num_workers=2,--nproc 2)

.PHONY: install lint test check fake-cuda demo multi30k clean

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
	$(if $(wildcard $(DATA)/.),,$(error DATA=$(DATA): no such folder (it holds train, val and the test sets, .en/.de)))
	$(if $(TESTS),,$(error TESTS is empty: name at least one test set in DATA, e.g. TESTS=test_2016_flickr))
	$(if $(M30K_MISSING),$(error TESTS: DATA=$(DATA) has no $(M30K_MISSING) (plain or .gz): set DATA or TESTS))
	$(if $(M30K_BOTH),$(error TESTS: DATA=$(DATA) has $(M30K_BOTH) both plain and .gz: remove or move one of each))
	$(if $(M30K_ON_GPU),$(M30K_CUDA_CHECK))
	$(PY) -m megaformer.cli prepare --src en --tgt de --train $(DATA)/train --valid $(DATA)/val \
		--test $(DATA)/$(firstword $(TESTS)) --vocab-size 8000 --out $(M30K)/data --force
	$(PY) -m megaformer.cli train --config configs/multi30k.yaml --set data.path=$(M30K)/data --set model.dropout=$(M30K_DROPOUT) --set model.norm=$(M30K_NORM) \
		--set train.precision=$(M30K_PRECISION) --set train.zero_stage=$(if $(filter fp32,$(M30K_PRECISION)),0,1) --set train.tokens_per_step=$(M30K_TOKENS) --set train.lr_scale=$(M30K_LR_SCALE) \
		--set train.warmup_steps=$(M30K_WARMUP) --set train.cooldown_fraction=$(M30K_COOLDOWN) --set train.max_minutes=$(MINUTES) --set train.save_minutes=$(M30K_SAVE) --run-dir $(M30K_RUN) $(M30K_LAYOUT) --resume auto
	$(PY) -m megaformer.cli average --last 5 --run-dir $(M30K_RUN) --out $(M30K)/averaged$(M30K_TAG).pt --force
	$(foreach t,$(TESTS),$(call m30k_score,$(t)))

clean:
	rm -rf $(VENV) .cache build *.egg-info
