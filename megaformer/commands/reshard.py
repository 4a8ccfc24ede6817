"""``megaformer reshard``: rewrite a training checkpoint for another tensor-parallel size.

Nothing is destroyed: the new step directory is written into a hidden
temporary folder beside its destination and renamed into place only when complete.
The destination must not exist yet, so the command never replaces a checkpoint, least
of all its own input (``--ckpt RUN/checkpoints/step-N --out RUN/checkpoints`` names
the input itself and is refused before anything is written), and a ``step-N`` output
must be named for the step it holds (``latest`` and every reader trust the name).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megaformer.cli_args import existing_path, new_dir, positive_int
from megaformer.errors import CheckpointError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ckpt", type=existing_path, required=True, help="checkpoint step directory or run directory (its newest)"
    )
    p.add_argument(
        "--out", type=new_dir, required=True, help="checkpoints folder to write into, or a new step-N directory"
    )
    p.add_argument("--tp", type=positive_int, required=True, help="tensor-parallel size of the output (>= 1)")


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def target_of(step_dir: Path, out: Path, step: int | None = None) -> Path:
    """Where the resharded copy of ``step_dir`` (of ``step``: read from its meta.json if not given) goes; refuses
    anything that would replace or nest in a checkpoint."""
    from megaformer.checkpoint import STEP_DIR, check_complete, check_step_name

    if step is None:
        step = check_complete(step_dir)["step"]
    check_step_name(out, step)  # --out RUN/checkpoints/step-99999999 of step 20
    if (out / "checkpoints").is_dir():  # a step beside checkpoints/ is read by nothing
        raise CheckpointError(
            f"--out {out}: is a run directory, whose checkpoints are read from {out / 'checkpoints'}: pass that "
            f"folder as --out (or a new folder)"
        )
    target = out if STEP_DIR.match(out.name) else out / step_dir.name
    here, there = step_dir.resolve(), target.resolve()
    if there == here:
        raise CheckpointError(
            f"--out {out}: would replace the input checkpoint {step_dir}; write to another folder, "
            f"e.g. --out {step_dir.parent.parent / 'resharded'}"
        )
    if here in there.parents:
        raise CheckpointError(f"--out {out}: is inside the input checkpoint {step_dir}; write to another folder")
    if there.exists() or target.is_symlink():
        raise CheckpointError(f"--out {out}: {target} already exists; reshard does not replace checkpoints")
    return target


def main(args: argparse.Namespace) -> int:
    from megaformer.checkpoint import locate, reshard

    source = locate(Path(args.ckpt), log=_stderr, everything=True)  # verified once; an older one is announced
    step_dir = source.path
    target = target_of(step_dir, Path(args.out), source.meta["step"])
    reshard(source, target, args.tp, log=_stderr)  # written beside the target, renamed into place when complete
    print(f"reshard: wrote {target} from {step_dir} for tp={args.tp}")
    return 0
