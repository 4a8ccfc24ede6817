"""``make demo``: the whole pipeline on the built-in corpus, on a CPU, in a few minutes.

``python -m megaformer.commands.demo [--dir DIR] [--pairs N] [--steps N]`` runs
:func:`megaformer.demo.run_demo`: every step a ``megaformer`` command, printed before it
runs. It is no sub-command of ``megaformer`` (it runs them).
"""

from __future__ import annotations

import argparse
import sys

from megaformer.cli_args import int_range, positive_int
from megaformer.demo import ROOT, run_demo
from megaformer.logs import configure as configure_logs


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default="runs/demo", help="where the corpus, shards and run go")
    p.add_argument("--pairs", type=positive_int, default=20000, help="training pairs of the built-in corpus")
    p.add_argument("--steps", type=int_range(2), default=600, help="optimizer steps in all (half before the resume)")


def main(args: argparse.Namespace) -> int:
    configure_logs()
    return run_demo(ROOT / args.dir, args.pairs, args.steps)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
