"""On a CPU: one process using every core, or one data-parallel rank per core? Measured in one run.

    python benchmarks/cpu_processes.py --data DIR [--config configs/multi30k.yaml] [--precision fp32]
        [--steps 40] [--warmup 10] [--rounds 2] [--tokens-per-step N] [--json]

The real ``megaformer train`` trains ``--config`` on the prepared data ``--data`` (e.g.
``runs/multi30k/data`` after ``make multi30k``, or any ``megaformer prepare`` output) for
``--steps`` steps, eager, at the same ``train.tokens_per_step`` (the config's, or
``--tokens-per-step``): once as one process with all the machine's cores as torch threads
(``--nproc 1``), once as one rank per core of one thread each (``--nproc N``), alternating
``--rounds`` times so that a drift of the machine's speed touches both. From each run's
``metrics.jsonl`` it takes the target tokens per second of the steps after ``--warmup``
(training seconds only) and prints the median of each and the ratio ``ranks / one_process``
(above 1: the ranks are faster). ``make multi30k`` takes the faster (the Makefile says which and
the figure).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from megaformer.cli import Parser
from megaformer.cli_args import nonneg_int, positive_int

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["train.log_interval=1", "train.eval_interval=0", "train.save_interval=0", "train.save_minutes=0"]
COMMON += ["train.compile=false", "train.max_minutes=0"]


def _tokens_per_second(run_dir: Path, warmup: int) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = sorted((r for r in records if r.get("kind") == "train"), key=lambda r: r["step"])
    first, last = next(r for r in train if r["step"] == warmup), train[-1]
    seconds = last["train_seconds"] - first["train_seconds"]
    return (last["tokens"] - first["tokens"]) / seconds


def _train(args: argparse.Namespace, nproc: int, work: Path, index: int) -> float:
    run_dir = work / f"run-{nproc}-{index}"
    sets = [f"data.path={args.data}", f"train.max_steps={args.steps}", f"train.precision={args.precision}"]
    sets += [f"train.zero_stage={0 if args.precision == 'fp32' else 1}", *COMMON]
    if args.tokens_per_step:
        sets.append(f"train.tokens_per_step={args.tokens_per_step}")
    cmd = [sys.executable, "-m", "megaformer.cli", "train", "--config", args.config, "--run-dir", str(run_dir)]
    cmd += ["--nproc", str(nproc), "--resume", "none"] + [a for s in sets for a in ("--set", s)]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "RANK", "WORLD_SIZE")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(
            f"cpu_processes: megaformer train --nproc {nproc} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}"
        )
    return _tokens_per_second(run_dir, args.warmup)


def main() -> int:
    p = Parser(prog="cpu_processes", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="a directory written by `megaformer prepare`")
    p.add_argument("--config", default="configs/multi30k.yaml")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--steps", type=positive_int, default=40)
    p.add_argument("--warmup", type=positive_int, default=10, help="steps left out of the rate")
    p.add_argument("--rounds", type=positive_int, default=2)
    p.add_argument("--tokens-per-step", type=nonneg_int, default=0, help="train.tokens_per_step (0: the config's)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if not (Path(args.data) / "manifest.json").is_file():
        sys.exit(f"cpu_processes: --data {args.data}: no manifest.json; run `megaformer prepare` first")
    if args.warmup < 1 or args.steps <= args.warmup:
        sys.exit(f"cpu_processes: --steps {args.steps} must exceed --warmup {args.warmup} (>= 1)")
    cores = os.cpu_count() or 1
    if cores < 2:
        sys.exit("cpu_processes: one core: nothing to compare")
    one, ranks = [], []
    with tempfile.TemporaryDirectory(prefix="megaformer-cpu-procs-") as tmp:
        for index in range(args.rounds):
            one.append(_train(args, 1, Path(tmp), index))
            ranks.append(_train(args, cores, Path(tmp), index))
    result = {
        "cores": cores,
        "precision": args.precision,
        "tokens_per_step": args.tokens_per_step or None,  # None: the config's
        "one_process_tokens_per_s": statistics.median(one),
        "ranks_tokens_per_s": statistics.median(ranks),
        "ranks_over_one_process": statistics.median(ranks) / statistics.median(one),
        "runs": {"one_process": one, "ranks": ranks},
    }
    if args.json:
        print(json.dumps(result))
    else:
        tokens = args.tokens_per_step or "the config's"
        print(f"{cores} cores, {args.precision}, eager, {tokens} tokens a step, ", end="")
        print(f"{args.steps} steps ({args.warmup} left out), {args.rounds} rounds")
        print(f"  1 process x {cores} threads: {result['one_process_tokens_per_s']:,.0f} target tokens/s")
        print(f"  {cores} ranks x 1 thread:    {result['ranks_tokens_per_s']:,.0f} target tokens/s")
        print(f"  ranks / one process: {result['ranks_over_one_process']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
