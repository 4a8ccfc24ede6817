"""``megaformer average``: one model file holding the mean of several (paper, section 6.1).

``--ckpts C1 C2 ...`` averages the given model files or checkpoint step directories;
``--last N --run-dir DIR`` the N newest complete checkpoints of a training run (the
paper averages the last 5; see :func:`megaformer.decode.evaluate.last_checkpoints`).
"""

from __future__ import annotations

import argparse
import sys

from megaformer.decode.evaluate import average_checkpoints, last_checkpoints
from megaformer.errors import CheckpointError, ConfigError
from megaformer.train.checkpoint import save_consolidated


def add_arguments(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--ckpts", nargs="+", metavar="CKPT", help="model files or checkpoint step directories to average"
    )
    which.add_argument("--last", type=int, metavar="N", help="average the N newest checkpoints of --run-dir")
    parser.add_argument("--run-dir", help="training run directory (with --last)")
    parser.add_argument("--out", required=True, help="where the averaged model file goes")


def main(args: argparse.Namespace) -> int:
    if args.last is not None:
        if not args.run_dir:
            raise ConfigError("--last needs --run-dir")
        if args.last < 1:
            raise ConfigError(f"--last must be at least 1, got {args.last}")
        paths = last_checkpoints(args.run_dir, args.last)
    else:
        if args.run_dir:
            raise ConfigError("--run-dir goes with --last, not with --ckpts")
        paths = args.ckpts
    model = average_checkpoints(paths)
    try:
        save_consolidated(args.out, model)
    except OSError as err:
        raise CheckpointError(f"{args.out}: cannot write ({err.strerror or err})") from None
    print(f"averaged {len(paths)} models into {args.out}", file=sys.stderr)
    return 0
