"""``megaformer multi30k`` (``make multi30k``): Multi30k en->de in a budget of minutes, the settings chosen for the machine.

``megaformer multi30k [--data DIR] [--minutes M] [--tests "NAME ..."] [--gpus N] [--precision bf16|fp32]
[--work DIR] [--dry-run]`` runs :func:`megaformer.recipes.multi30k.run_multi30k`: prepare, train for the
minutes, average the last 5 checkpoints, score each test set; every step a ``megaformer`` command logged
before it runs (``--dry-run``: only logged). A run of other than 60 minutes has its own run dir, averaged
model and hypotheses (``run-15m``, ``averaged-15m.pt``, ``NAME-15m.hyp``), so it never resumes the hour's.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from megaformer.cli_args import new_dir, nonneg_int
from megaformer.recipes.multi30k import Machine, Multi30k, run_multi30k, steps


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", default="../shared/data/multi30k", help="train, val and the test sets (.en/.de)")
    p.add_argument("--minutes", default="60", help="training minutes, a number above 0 (default: %(default)s)")
    p.add_argument(
        "--tests",
        default="test_2016_flickr",
        help="test sets in DATA, space-separated, each scored at the end; the first is prepared with the data",
    )
    p.add_argument("--gpus", type=nonneg_int, help="CUDA GPUs to use: 0 trains on the CPU (default: nvidia-smi's)")
    p.add_argument("--precision", choices=("bf16", "fp32"), help="default: bf16 on a GPU or a CPU with native bf16")
    p.add_argument(
        "--work",
        type=new_dir,
        default="runs/multi30k",
        help="where the data, runs and scores go (default: %(default)s)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")


def main(args: argparse.Namespace) -> int:
    machine = Machine.detect()
    if args.gpus is not None:
        machine = dataclasses.replace(machine, gpus=args.gpus)
    recipe = Multi30k(
        data=Path(args.data).resolve(),
        work=Path(args.work).resolve(),
        minutes=args.minutes,
        tests=tuple(args.tests.split()),
        precision=args.precision,
    )
    if args.dry_run:  # the commands are this option's output, shown under -q too
        print("\n".join(step.shown() for step in steps(recipe, machine)))
        return 0
    return run_multi30k(recipe, machine)
