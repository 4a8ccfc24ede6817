"""``megaformer average``: one model file holding the mean of several (paper, section 6.1).

``--ckpt C1 C2 ...`` averages the given model files or checkpoint step directories;
``--run-dir DIR [--last N]`` the N newest complete checkpoints of a training run, N
defaulting to the run's ``decode.average_last`` (the paper averages the last 5; see
:func:`megaformer.decode.evaluate.last_checkpoints`). Damaged checkpoints skipped on the
way are announced on stderr.

Nothing is destroyed: the model file is written to a temporary file and renamed into
place (``save_consolidated``), and an ``--out`` that is one of the inputs is refused.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megaformer.checkpoint import (
    STEP_DIR,
    average_checkpoints,
    check_complete,
    check_step_name,
    last_checkpoints,
    resolve_checkpoint,
    save_consolidated,
)
from megaformer.cli_args import existing_dir, existing_path, new_file, positive_int
from megaformer.config import from_dict
from megaformer.decode.translate import open_model
from megaformer.errors import CheckpointError, ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--ckpt",
        type=existing_path,
        nargs="+",
        metavar="CKPT",
        help="model files or checkpoint step directories to average",
    )
    which.add_argument("--run-dir", type=existing_dir, help="training run directory: average its newest checkpoints")
    parser.add_argument(
        "--last",
        type=positive_int,
        metavar="N",
        help="with --run-dir: how many (default: the run's decode.average_last)",
    )
    parser.add_argument("--out", type=new_file, required=True, help="where the averaged model file goes")


def _stderr(message: str) -> None:
    print(f"megaformer average: {message}", file=sys.stderr)


def _run_paths(run_dir: str, last: int | None) -> list[Path]:
    """The checkpoints of ``run_dir`` to average: ``last``, or the newest checkpoint's decode.average_last
    (no more than the run keeps: its train.keep_last)."""
    if last is not None:
        return last_checkpoints(run_dir, last, log=_stderr)
    newest = resolve_checkpoint(Path(run_dir), log=lambda m: None)  # skips are announced just below
    cfg = from_dict(check_complete(newest)["config"])
    last, asked_by = cfg.decode.average_last, "the run's decode.average_last"
    if 0 < cfg.train.keep_last < last:
        _stderr(
            f"averaging the last {cfg.train.keep_last}: the run keeps {cfg.train.keep_last} checkpoints "
            f"(train.keep_last), decode.average_last asks for {last}"
        )
        last, asked_by = cfg.train.keep_last, "the run's train.keep_last"
    return last_checkpoints(run_dir, last, log=_stderr, asked_by=asked_by)


def _check_out(out: str, paths: list[Path]) -> None:
    """Refuse an output that would replace one of the inputs, or land inside a step directory being read."""
    target = Path(out).resolve()
    for p in paths:
        source = Path(p).resolve()
        if target == source or (STEP_DIR.match(source.name) and source in target.parents):
            raise ConfigError(f"--out {out}: would overwrite the input {p}; write the average elsewhere")


def main(args: argparse.Namespace) -> int:
    if args.run_dir is not None:
        paths = _run_paths(args.run_dir, args.last)
    else:
        if args.last is not None:
            raise ConfigError("--last goes with --run-dir, not with --ckpt")
        paths = [Path(p) for p in args.ckpt]
    _check_out(args.out, paths)
    model = average_checkpoints(paths, load=lambda p: open_model(p, "average")[0])
    check_step_name(Path(args.out), model.meta.get("step"))  # not a step-N name that says another step
    try:
        save_consolidated(args.out, model)
    except OSError as err:
        raise CheckpointError(f"{args.out}: cannot write ({err.strerror or err})") from None
    print(
        f"averaged {len(paths)} model{'s' * (len(paths) != 1)} (steps {model.meta['averaged_steps']}) into {args.out}",
        file=sys.stderr,
    )
    return 0
