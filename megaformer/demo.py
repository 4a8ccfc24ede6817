"""``make demo``: the whole pipeline on the built-in corpus, on a CPU, in a few minutes.

generate the corpus -> prepare shards -> train configs/tiny.yaml with 2 processes at
TP=2 (half the steps) -> resume from the checkpoint for the rest -> translate a few
test sentences -> BLEU on the test split -> where the logs are. Every step is a
``megaformer`` command, printed before it runs, so a newcomer can repeat any of them.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from megaformer.cli_args import int_range, positive_int

ROOT = Path(__file__).resolve().parents[1]


def _run(title: str, args: list[str], capture: bool = False) -> str:
    command = [sys.executable, "-m", "megaformer.cli", *args]
    print(f"\n== {title}\n$ megaformer {shlex.join(args)}", flush=True)
    env = {
        **os.environ,
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions")),
    }
    proc = subprocess.run(command, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE if capture else None)
    if proc.returncode != 0:
        print(f"demo: `megaformer {args[0]}` failed with status {proc.returncode}", file=sys.stderr)
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
        "train.eval_interval=100",
        "--set",
        "train.save_interval=100",
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="runs/demo", help="where the corpus, shards and run go")
    p.add_argument("--pairs", type=positive_int, default=20000, help="training pairs of the built-in corpus")
    p.add_argument("--steps", type=int_range(2), default=800, help="optimizer steps in all (half before the resume)")
    args = p.parse_args()
    started = time.monotonic()
    work = ROOT / args.dir
    data, run = work / "data", work / "run"
    common = _train_options(run, data)

    if not (data / "manifest.json").is_file():
        _run(
            "generate the built-in corpus and prepare shards",
            ["prepare", "--synthetic", str(args.pairs), "--out", str(data)],
        )
    _run(
        f"train at TP=2 (2 processes) to step {args.steps // 2}",
        ["train", *common, "--resume", "none", "--set", f"train.max_steps={args.steps // 2}"],
    )
    _run(
        f"resume from the last checkpoint and train to step {args.steps}",
        ["train", *common, "--resume", "auto", "--set", f"train.max_steps={args.steps}"],
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
        print(f"  source     {src}\n  output     {hyp}\n  reference  {ref}\n")
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
    print(
        f"\ndemo: done in {time.monotonic() - started:.0f} s. Metrics: {run / 'metrics.jsonl'}; "
        f"tensorboard --logdir {run / 'tensorboard'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
