"""WMT'14 en-de from its downloads to the paper's two BLEU figures (``make wmt14 RAW=DIR``).

The steps, each a ``megaformer`` command logged before it runs:

1. ``prepare`` from the five archives as WMT distributes them (:data:`DOWNLOADS`), read in place:
   train = Europarl v7 + Common Crawl + News Commentary v9 (their ``de-en`` members), valid =
   newstest2013 (``dev.tgz``), test = newstest2014 in full (3,003 sentences, ``test-full.tgz``), one
   shared sentencepiece vocabulary (37,000 pieces, as the paper's). Kept when ``WORK/data`` already
   holds a prepare's manifest.
2. ``train``: under SLURM through ``slurm/train_big.sh`` (``sbatch --wait``; ``RUN_DIR`` and ``CONFIG``
   passed in its environment, so a requeued or resubmitted job resumes the same run), or, where
   no SLURM controller answers, as local processes. Either way ``--resume auto``: running the recipe
   again continues the run.
3. ``average`` the last checkpoints (the config's ``decode.average_last``: 20 for the big model).
4. ``evaluate`` the averaged model on newstest2014: sacreBLEU's line and the paper's tokenized,
   compound-split BLEU.
"""

from __future__ import annotations

import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path

from megaformer.errors import ConfigError
from megaformer.recipes.steps import ROOT, RecipeError, Step, megaformer

LOG = logging.getLogger(__name__)
SRC, TGT = "en", "de"
# The files of https://www.statmt.org/wmt14/translation-task.html, by their download names.
TRAIN_ARCHIVES = (
    "training-parallel-europarl-v7.tgz",
    "training-parallel-commoncrawl.tgz",
    "training-parallel-nc-v9.tgz",
)
VALID, TEST = "dev.tgz:newstest2013", "test-full.tgz:newstest2014"
DOWNLOADS = (*TRAIN_ARCHIVES, VALID.split(":")[0], TEST.split(":")[0])
LAUNCHES = ("auto", "slurm", "local")


@dataclass(frozen=True)
class Wmt14:
    """One reproduction: where the downloads are, where it works, and how it trains.

    ``sets`` are ``section.key=value`` overrides for training; ``sbatch`` is the command that
    submits (``sbatch``, or a wrapper such as ``slurm/testcluster.sh exec sbatch``), given
    ``sbatch_args`` before the script; ``nproc`` the local processes where SLURM is not used.
    """

    raw: Path
    work: Path
    config: Path = ROOT / "configs" / "transformer_big.yaml"
    vocab_size: int = 37000
    sets: tuple[str, ...] = ()
    launch: str = "auto"
    sbatch: tuple[str, ...] = ("sbatch",)
    sbatch_args: tuple[str, ...] = ()
    nproc: int = 1
    average: int | None = None

    @property
    def data(self) -> Path:
        return self.work / "data"

    @property
    def run(self) -> Path:
        return self.work / "run"

    @property
    def averaged(self) -> Path:
        return self.work / "averaged.pt"


def check_downloads(raw: Path) -> None:
    """Every archive of :data:`DOWNLOADS` is a file in ``raw``; else one line naming those missing."""
    if not raw.is_dir():
        raise RecipeError(f"RAW={raw}: no such folder (the folder holding WMT'14's downloads: {', '.join(DOWNLOADS)})")
    missing = [name for name in DOWNLOADS if not (raw / name).is_file()]
    if missing:
        raise RecipeError(
            f"RAW={raw} lacks {', '.join(missing)}: download them from https://www.statmt.org/wmt14/"
            f"translation-task.html under these names"
        )


def prepare_command(recipe: Wmt14) -> list[str]:
    """``megaformer prepare`` of the paper's sets, read from the archives in place."""
    args = ["prepare", "--src", SRC, "--tgt", TGT]
    for name in TRAIN_ARCHIVES:
        args += ["--train", str(recipe.raw / name)]
    args += ["--valid", str(recipe.raw / VALID), "--test", str(recipe.raw / TEST)]
    return [*args, "--vocab-size", str(recipe.vocab_size), "--out", str(recipe.data)]


def _overrides(recipe: Wmt14) -> list[str]:
    sets = [f"data.path={recipe.data}", *recipe.sets]
    return [arg for s in sets for arg in ("--set", s)]


def slurm_answers(recipe: Wmt14) -> bool:
    """Whether a SLURM controller answers ``sinfo`` through the same wrapper as ``sbatch``."""
    *wrapper, _ = recipe.sbatch
    try:
        proc = subprocess.run([*wrapper, "sinfo", "-h"], cwd=ROOT, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def uses_slurm(recipe: Wmt14) -> bool:
    """``launch``: ``slurm`` and ``local`` as said; ``auto`` is SLURM where a controller answers."""
    if recipe.launch not in LAUNCHES:
        raise ConfigError(f"--launch {recipe.launch}: use one of {', '.join(LAUNCHES)}")
    return recipe.launch == "slurm" or (recipe.launch == "auto" and slurm_answers(recipe))


def train_command(recipe: Wmt14, slurm: bool) -> tuple[list[str], dict[str, str]]:
    """The training command (a full argv) and the environment it adds: sbatch of train_big.sh, or local."""
    if slurm:
        out = recipe.work / "train-%j.out"
        argv = [*recipe.sbatch, "--wait", f"--output={out}", *recipe.sbatch_args, "slurm/train_big.sh"]
        return [*argv, *_overrides(recipe)], {"RUN_DIR": str(recipe.run), "CONFIG": str(recipe.config)}
    args = ["train", "--config", str(recipe.config), "--run-dir", str(recipe.run), "--resume", "auto"]
    return [*megaformer(*args), "--nproc", str(recipe.nproc), *_overrides(recipe)], {}


def average_command(recipe: Wmt14) -> list[str]:
    last = [] if recipe.average is None else ["--last", str(recipe.average)]
    return ["average", "--run-dir", str(recipe.run), *last, "--out", str(recipe.averaged), "--force"]


def evaluate_command(recipe: Wmt14) -> list[str]:
    """Score the averaged model on newstest2014's raw text, as prepare kept it (``test.en`` / ``test.de``)."""
    data = recipe.data
    hyp = recipe.work / "newstest2014.hyp"
    args = ["evaluate", "--ckpt", str(recipe.averaged), "--input", str(data / f"test.{SRC}")]
    return [*args, "--ref", str(data / f"test.{TGT}"), "--output", str(hyp), "--lang", TGT]


def run_wmt14(recipe: Wmt14) -> int:
    """prepare (unless done) -> train -> average -> evaluate; 0, or a RecipeError naming the step."""
    check_downloads(recipe.raw)
    recipe.work.mkdir(parents=True, exist_ok=True)
    if (recipe.data / "manifest.json").is_file():
        LOG.info("wmt14: %s is prepared already: kept (remove it to prepare again)", recipe.data)
    else:
        Step("prepare WMT'14 en-de from the archives", megaformer(*prepare_command(recipe))).run()
    slurm = uses_slurm(recipe)
    argv, env = train_command(recipe, slurm)
    where = "through slurm/train_big.sh (sbatch --wait)" if slurm else f"in {recipe.nproc} local process(es)"
    Step(f"train {recipe.config.name} {where}", argv, env).run()
    Step("average the last checkpoints", megaformer(*average_command(recipe))).run()
    Step("score newstest2014 (sacreBLEU and the paper's tokenized BLEU)", megaformer(*evaluate_command(recipe))).run()
    LOG.info("wmt14: done; hypotheses in %s, the run in %s", recipe.work / "newstest2014.hyp", recipe.run)
    return 0
