"""``megaformer wmt14`` (``make wmt14 RAW=DIR``): WMT'14 en-de from its downloads, trained, averaged, scored both ways.

``megaformer wmt14 --raw DIR [--work DIR] [--config C] [--set k=v ...] [--launch
auto|slurm|local] [--sbatch CMD] [--sbatch-args ARGS] [--nproc N] [--vocab-size N] [--average N]``
runs :func:`megaformer.recipes.wmt14.run_wmt14`: every step a ``megaformer`` command (or the sbatch of
``slurm/train_big.sh``), logged before it runs; a step that fails ends it with one line naming the step.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from megaformer.cli_args import existing_dir, existing_file, int_range, new_dir, positive_int
from megaformer.errors import MegaformerError
from megaformer.recipes.wmt14 import DOWNLOADS, LAUNCHES, ROOT, Wmt14, run_wmt14


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--raw", type=existing_dir, required=True, help=f"the folder of WMT'14's {', '.join(DOWNLOADS)}")
    p.add_argument(
        "--work", type=new_dir, default="runs/wmt14", help="where the data, run and scores go (default: %(default)s)"
    )
    p.add_argument("--config", type=existing_file, default=str(ROOT / "configs" / "transformer_big.yaml"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="training override (repeat)")
    p.add_argument("--vocab-size", type=int_range(100), default=37000, help="shared pieces (the paper's 37,000)")
    p.add_argument(
        "--launch",
        choices=LAUNCHES,
        default="auto",
        help="slurm: sbatch slurm/train_big.sh; local: --nproc processes here; auto: slurm where sinfo answers",
    )
    p.add_argument("--sbatch", default="sbatch", help="the command that submits (default: %(default)s)")
    p.add_argument("--sbatch-args", default="", help="sbatch options before the script, e.g. '--nodes=2'")
    p.add_argument("--nproc", type=positive_int, default=1, help="local processes (with --launch local)")
    p.add_argument("--average", type=positive_int, help="checkpoints averaged (default: the config's average_last)")


def _words(option: str, text: str) -> tuple[str, ...]:
    try:
        return tuple(shlex.split(text))
    except ValueError as err:
        raise MegaformerError(f"{option} {text!r}: {err}") from None


def recipe_from_args(args: argparse.Namespace, cwd: Path) -> Wmt14:
    """Paths as the user typed them, relative to where they typed them (the recipe runs from the checkout)."""
    sbatch = _words("--sbatch", args.sbatch)
    if not sbatch:
        raise MegaformerError("--sbatch '': name the command that submits a job (sbatch)")
    return Wmt14(
        raw=(cwd / args.raw).resolve(),
        work=(cwd / args.work).resolve(),
        config=(cwd / args.config).resolve(),
        vocab_size=args.vocab_size,
        sets=tuple(args.set),
        launch=args.launch,
        sbatch=sbatch,
        sbatch_args=_words("--sbatch-args", args.sbatch_args),
        nproc=args.nproc,
        average=args.average,
    )


def main(args: argparse.Namespace) -> int:
    return run_wmt14(recipe_from_args(args, Path.cwd()))
