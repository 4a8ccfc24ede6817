"""The whole pipeline on the built-in corpus, on a CPU, in a few minutes (``make demo``).

generate the corpus -> prepare shards -> train configs/tiny.yaml with 2 processes at
TP=2 (half the steps) -> resume from the checkpoint for the rest -> translate a few
test sentences -> BLEU on the test split -> where the logs are. Every step is a
``megaformer`` command, printed before it runs, so a newcomer can repeat any of them.
The options are :mod:`megaformer.commands.demo`'s.
"""

from __future__ import annotations

import logging
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOG = logging.getLogger(__name__)


def _run(title: str, args: list[str], capture: bool = False) -> str:
    command = [sys.executable, "-m", "megaformer.cli", *args]
    LOG.info(f"\n== {title}\n$ megaformer {shlex.join(args)}")
    proc = subprocess.run(command, cwd=ROOT, text=True, stdout=subprocess.PIPE if capture else None)
    if proc.returncode != 0:
        LOG.error(f"demo: `megaformer {args[0]}` failed with status {proc.returncode}")
        sys.exit(proc.returncode)
    return proc.stdout or ""


def _train_options(run: Path, data: Path) -> list[str]:
    """The options both training calls share: tiny config, TP=2 over 2 local processes, frequent saves."""
    return [
        "--config",
        "configs/tiny.yaml",
        "--run-dir",
        str(run),
        "--nproc",
        "2",
        "--set",
        f"data.path={data}",
        "--set",
        "parallel.tp=2",
        "--set",
        "train.log_interval=25",
        "--set",
        "train.eval_interval=150",
        "--set",
        "train.save_interval=150",
    ]


def run_demo(work: Path, pairs: int, steps: int) -> int:
    """The demo in ``work``: ``pairs`` training pairs, ``steps`` optimizer steps in all (half before the resume).

    The corpus and shards go to ``work/data``, the run to ``work/run``. A step that fails
    ends the process with its status.
    """
    started = time.monotonic()
    data, run = work / "data", work / "run"
    common = _train_options(run, data)

    if not (data / "manifest.json").is_file():
        _run(
            "generate the built-in corpus and prepare shards",
            ["prepare", "--synthetic", str(pairs), "--out", str(data)],
        )
    if run.is_dir():  # an earlier demo's run: this one starts afresh (train refuses to mix them)
        LOG.info(f"removing the previous demo run {run}")
        shutil.rmtree(run)
    _run(
        f"train at TP=2 (2 processes) to step {steps // 2}",
        ["train", *common, "--resume", "none", "--set", f"train.max_steps={steps // 2}"],
    )
    _run(
        f"resume from the last checkpoint and train to step {steps}",
        ["train", *common, "--resume", "auto", "--set", f"train.max_steps={steps}"],
    )
    sample = data / "demo_sample.xx"
    lines = (data / "test.xx").read_text().splitlines()[:5]
    sample.write_text("\n".join(lines) + "\n")
    out = _run(
        "translate five test sentences (beam 4)",
        ["translate", "--ckpt", str(run), "--input", str(sample), "--quiet"],
        capture=True,
    )
    refs = (data / "test.yy").read_text().splitlines()[:5]
    for src, hyp, ref in zip(lines, out.splitlines(), refs):
        LOG.info(f"  source     {src}\n  output     {hyp}\n  reference  {ref}\n")
    _run(
        "BLEU on the test split",
        [
            "evaluate",
            "--ckpt",
            str(run),
            "--input",
            str(data / "test.xx"),
            "--ref",
            str(data / "test.yy"),
            "--output",
            str(work / "test.hyp"),
        ],
    )
    LOG.info(
        f"\ndemo: done in {time.monotonic() - started:.0f} s. Metrics: {run / 'metrics.jsonl'}; "
        f"tensorboard --logdir {run / 'tensorboard'}"
    )
    return 0
