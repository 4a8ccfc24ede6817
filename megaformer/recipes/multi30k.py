"""Multi30k en->de in a budget of minutes (``make multi30k``): the choices for the machine, then the commands.

The steps, each a ``megaformer`` command logged before it runs: ``prepare`` (an 8,000-piece shared
sentencepiece BPE; the first test set prepared with the data), ``train`` ``configs/multi30k.yaml`` for
the minutes, ``average`` the last 5 checkpoints (one is saved every minutes/24, so they span the last
~20 % of any run length), ``evaluate`` every test set.

:func:`choose` picks the settings from the machine (a CUDA GPU; native bf16 on the CPU) and the steps
the run is expected to reach (:data:`STEPS_PER_MINUTE`, of 3,000 tokens). The run itself measures its
real rate: the trainer fits the warm-up and the cool-down to the steps it will reach
(``train/budget.py``); the step sizes, norm, dropout and peak learning rates are chosen here, before it
starts. Where each threshold and value came from (the runs behind them) is in ``docs/results.md``
("The Multi30k recipe's choices").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from megaformer.errors import ConfigError, DataError
from megaformer.recipes.steps import Step, megaformer, shown_path

CONFIG = "configs/multi30k.yaml"
VOCAB = 8000
AVERAGE_LAST = 5
SAVES_PER_RUN = 24  # a checkpoint every minutes / 24: the last 5 span its last ~20 %
# Steps of 3,000 tokens a minute: two CPU cores in bf16 (AVX512-BF16 or AMX) ~125, in fp32 ~45;
# one GPU taken to reach ~2,000 (not yet measured).
# fp32_onednn: fp32 through oneDNN's AVX-512 kernels (parallel/cpu_matmul.py), 4,642 target tok/s on the 2-core EPYC
STEPS_PER_MINUTE = {"gpu": 2000, "bf16": 125, "fp32": 45, "fp32_onednn": 90}
SHORT_STEPS = 1000  # under this: the short recipe (1,000-token steps, pre-LN, dropout 0.1, peak 2.2e-3)
LONG_STEPS = 3600  # from this on: dropout 0.25 (under: 0.15), and bf16 CPU runs keep the plain lr decay


@dataclass(frozen=True)
class Machine:
    """What the recipe needs to know of where it runs: CUDA GPUs (as ``nvidia-smi`` lists them), native bf16, and
    fp32 products through oneDNN's AVX-512 kernels (:func:`megaformer.parallel.cpu_matmul.onednn_for_fp32`)."""

    gpus: int
    native_bf16: bool
    onednn_fp32: bool = False

    @classmethod
    def detect(cls, cpuinfo: str = "/proc/cpuinfo") -> Machine:
        import shutil
        import subprocess

        gpus = 0
        if shutil.which("nvidia-smi"):
            listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
            gpus = sum(line.startswith("GPU ") for line in listed.splitlines())
        try:
            flags = Path(cpuinfo).read_text()
        except OSError:
            flags = ""
        from megaformer.parallel.cpu_matmul import onednn_for_fp32  # the choice the training processes make

        native_bf16 = bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", flags))
        return cls(gpus=gpus, native_bf16=native_bf16, onednn_fp32=onednn_for_fp32())


@dataclass(frozen=True)
class Choices:
    """The training settings of one run, as ``--set`` overrides of ``configs/multi30k.yaml``."""

    precision: str
    expected_steps: float
    dropout: float
    norm: str
    tokens_per_step: int
    lr_scale: float
    warmup_steps: int
    cooldown_fraction: float
    minutes: str

    def overrides(self) -> list[str]:
        zero = 0 if self.precision == "fp32" else 1
        save = f"{float(self.minutes) / SAVES_PER_RUN:g}"
        values = (
            ("model.dropout", f"{self.dropout:g}"),
            ("model.norm", self.norm),
            ("train.precision", self.precision),
            ("train.zero_stage", zero),
            ("train.tokens_per_step", self.tokens_per_step),
            ("train.lr_scale", f"{self.lr_scale:g}"),
            ("train.warmup_steps", self.warmup_steps),
            ("train.cooldown_fraction", f"{self.cooldown_fraction:g}"),
            ("train.max_minutes", self.minutes),
            ("train.save_minutes", save),
        )
        return [arg for key, value in values for arg in ("--set", f"{key}={value}")]


def check_minutes(text: str) -> str:
    """``text`` as typed when it is a number above 0 (it names the run: ``run-15m``); else a ConfigError."""
    if not re.fullmatch(r"[0-9]*\.?[0-9]+", text.strip()) or float(text) <= 0:
        raise ConfigError(f"MINUTES={text} (--minutes): the training minutes, a number above 0 (e.g. MINUTES=15)")
    return text.strip()


def choose(minutes: str, machine: Machine, precision: str | None = None) -> Choices:
    """The settings for ``minutes`` on ``machine`` (``precision`` as the user forces it, else bf16 where native)."""
    minutes = check_minutes(minutes)
    gpu = machine.gpus > 0
    precision = precision or ("bf16" if gpu or machine.native_bf16 else "fp32")
    if precision not in ("bf16", "fp32"):
        raise ConfigError(f"M30K_PRECISION={precision}: use bf16 or fp32")
    rate = "gpu" if gpu else "fp32_onednn" if precision == "fp32" and machine.onednn_fp32 else precision
    steps = float(minutes) * STEPS_PER_MINUTE[rate]
    short = steps < SHORT_STEPS
    small_steps = short or precision == "fp32"  # steps of 1,000 tokens, pre-LN layers
    long_fp32 = precision == "fp32" and not short  # warmed up over 1,000 updates to 2.2e-3
    cool = not gpu and precision == "bf16" and steps < LONG_STEPS  # the lr ramped to 0 over the last 30 %
    if long_fp32:
        lr_scale = 1.1132
    elif short:
        lr_scale = 0.704
    else:
        lr_scale = 0.768 if cool else 0.512
    return Choices(
        precision=precision,
        expected_steps=steps,
        dropout=0.1 if short else (0.15 if steps < LONG_STEPS else 0.25),
        norm="pre" if small_steps else "post",
        tokens_per_step=1000 if small_steps else 3000,
        lr_scale=lr_scale,
        warmup_steps=1000 if long_fp32 else 400,
        cooldown_fraction=0.3 if cool else 0.0,
        minutes=minutes,
    )


def layout(machine: Machine) -> list[str]:
    """One process of one GPU (one micro-batch a step, two loader workers), or two data-parallel CPU processes."""
    if machine.gpus:
        sets = ("parallel.device=cuda", "data.max_tokens=3072", "data.num_workers=2")
        return ["--nproc", "1", *(arg for s in sets for arg in ("--set", s))]
    return ["--nproc", "2"]


def data_side(data: Path, name: str, lang: str) -> Path:
    """``DATA/NAME.lang``, plain or gzip; a DataError where neither or both exist."""
    found = [p for p in (data / f"{name}.{lang}", data / f"{name}.{lang}.gz") if p.is_file()]
    if not found:
        raise DataError(f"TESTS: DATA={data} has no {name}.{lang} (plain or .gz): set DATA or TESTS")
    if len(found) == 2:
        raise DataError(f"TESTS: DATA={data} has {name}.{lang} both plain and .gz: remove or move one of them")
    return found[0]


@dataclass(frozen=True)
class Multi30k:
    """One run: the data folder (train, val and the test sets, ``.en`` / ``.de``), where it works, its minutes."""

    data: Path
    work: Path
    minutes: str = "60"
    tests: tuple[str, ...] = ("test_2016_flickr",)
    precision: str | None = None

    @property
    def tag(self) -> str:
        """``""`` for the hour, else ``-15m``: a run of other minutes has its own run dir, model and hypotheses."""
        return "" if self.minutes == "60" else f"-{self.minutes}m"


def steps(recipe: Multi30k, machine: Machine) -> list[Step]:
    """prepare -> train -> average -> evaluate each test set; every input checked before the first runs."""
    if not recipe.data.is_dir():
        raise DataError(f"DATA={recipe.data}: no such folder (it holds train, val and the test sets, .en/.de)")
    if not recipe.tests:
        raise DataError("TESTS is empty: name at least one test set in DATA, e.g. TESTS=test_2016_flickr")
    sides = {name: [data_side(recipe.data, name, lang) for lang in ("en", "de")] for name in recipe.tests}
    choices = choose(recipe.minutes, machine, recipe.precision)
    data, run = shown_path(recipe.work / "data"), shown_path(recipe.work / f"run{recipe.tag}")
    averaged = shown_path(recipe.work / f"averaged{recipe.tag}.pt")
    raw = shown_path(recipe.data)
    prepare = ["prepare", "--src", "en", "--tgt", "de", "--train", f"{raw}/train", "--valid", f"{raw}/val"]
    prepare += ["--test", f"{raw}/{recipe.tests[0]}", "--vocab-size", str(VOCAB), "--out", data, "--force"]
    train = ["train", "--config", CONFIG, "--set", f"data.path={data}", *choices.overrides(), "--run-dir", run]
    plan = [
        Step("prepare the data and an 8,000-piece shared BPE", megaformer(*prepare)),
        Step(
            f"train {choices.precision} for {recipe.minutes} minutes (~{choices.expected_steps:,.0f} steps expected)",
            megaformer(*train, *layout(machine), "--resume", "auto"),
        ),
        Step(
            f"average the last {AVERAGE_LAST} checkpoints",
            megaformer("average", "--last", str(AVERAGE_LAST), "--run-dir", run, "--out", averaged, "--force"),
        ),
    ]
    for name, (src, ref) in sides.items():
        hyp = shown_path(recipe.work / f"{name}{recipe.tag}.hyp")
        score = ["evaluate", "--ckpt", averaged, "--input", shown_path(src), "--ref", shown_path(ref), "--output", hyp]
        plan.append(Step(f"score {name}", megaformer(*score)))
    return plan


def check_gpu_torch(machine: Machine) -> None:
    """On a machine with a GPU, the torch of this interpreter must see it (a CPU build is refused first)."""
    if machine.gpus:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"nvidia-smi lists a GPU, but this torch ({torch.__version__}) sees none: install a CUDA build of "
                f"torch in the venv, or set M30K_GPUS=0 (--gpus 0) to train on the CPU"
            )


def run_multi30k(recipe: Multi30k, machine: Machine) -> int:
    """Every step in order; 0, or a RecipeError naming the step."""
    plan = steps(recipe, machine)
    check_gpu_torch(machine)
    for step in plan:
        step.run()
    return 0
