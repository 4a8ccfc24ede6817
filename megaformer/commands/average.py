"""``megaformer average``: one model file holding the mean of several (paper, section 6.1).

``--ckpt C1 C2 ...`` averages the given model files or checkpoint step directories;
``--run-dir DIR [--last N]`` the N newest complete checkpoints of a training run, N
defaulting to the run's ``decode.average_last`` (the paper averages the last 5; see
:func:`megaformer.decode.evaluate.last_checkpoints`). Damaged checkpoints skipped on the
way are announced on stderr.

Nothing is destroyed: the model file is written to a temporary file and renamed into
place (``save_consolidated``); an ``--out`` that is not NAME.pt, is or lies in an input, or exists
(without ``--force``, which replaces only a model file) is refused.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from megaformer.checkpoint import (
    POINTERS,
    STEP_DIR,
    CheckpointSource,
    SourceCheck,
    average_checkpoints,
    checkpoint_root,
    last_checkpoints,
    locate,
    resolve_checkpoint,
    save_consolidated,
)
from megaformer.cli_args import (
    existing_dir,
    existing_path,
    new_file,
    positive_int,
    refuse_output_over_inputs,
    refuse_to_replace,
)
from megaformer.config import from_dict
from megaformer.decode.loading import load_model_file
from megaformer.errors import CheckpointError, ConfigError
from megaformer.export.write import made_by_export
from megaformer.files import sha256_of


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
    parser.add_argument("--out", type=new_file, required=True, help="where the averaged model file goes (NAME.pt)")
    parser.add_argument("--force", action="store_true", help="replace --out if it is an earlier megaformer model file")


def _stderr(message: str) -> None:
    print(f"megaformer average: {message}", file=sys.stderr)


def _run_paths(run_dir: str, last: int | None) -> list[CheckpointSource]:
    """The checkpoints of ``run_dir`` to average: ``last``, or the newest checkpoint's decode.average_last
    (no more than the run keeps: its train.keep_last); each verified once, as a source to read."""
    check = SourceCheck()
    if last is not None:
        return [check.source(p) for p in last_checkpoints(run_dir, last, log=_stderr, check=check)]
    newest = resolve_checkpoint(Path(run_dir), log=lambda m: None, check=check)  # skips are announced just below
    cfg = from_dict(check.found[newest].meta["config"])
    last, asked_by = cfg.decode.average_last, "the run's decode.average_last"
    if 0 < cfg.train.keep_last < last:
        _stderr(
            f"averaging the last {cfg.train.keep_last}: the run keeps {cfg.train.keep_last} checkpoints "
            f"(train.keep_last), decode.average_last asks for {last}"
        )
        last, asked_by = cfg.train.keep_last, "the run's train.keep_last"
    found = check.found  # the steps verified already are not hashed again
    paths = last_checkpoints(run_dir, last, log=_stderr, asked_by=asked_by, check=lambda d: d in found or check(d))
    return [check.source(p) for p in paths]


def _check_out(out: Path, paths: list[Path], force: bool) -> None:
    """Refuse an output that is not NAME.pt (so never a step-N or pointer name), would replace or lie in what
    is read (any step of a run directory or pointer given: found by name, the shards are read once, by the
    average), or exists and is not an earlier model file (--force)."""
    if out.suffix != ".pt":
        raise ConfigError(
            f"--out {out}: average writes one megaformer model file: name it NAME.pt (`megaformer export` "
            f"then writes safetensors, hf or ct2)"
        )
    inputs = []
    for p in map(Path, paths):  # a run directory may hold the average beside its checkpoints, not in its steps
        pointer = p.is_file() and p.name in POINTERS
        root = p.parent if pointer else checkpoint_root(p) if p.is_dir() and not STEP_DIR.match(p.name) else None
        steps = sorted(s for s in root.glob("step-*") if s.is_dir()) if root is not None else []
        inputs += [("input", s) for s in steps] or [("input", p)]
    refuse_output_over_inputs("--out", out, inputs, "average")
    refuse_to_replace("--out", out, force, made_by_export, "no megaformer model")


def _refuse_twice(paths: list[Path]) -> None:
    """Refuse a checkpoint named twice however it is named: the same file or folder (a symlink, a hard link, another
    spelling), or a model file with the same bytes as another (a copy). An export of a step given with the step is
    found once loaded, by its recorded source (:func:`megaformer.checkpoint.average_checkpoints`)."""
    seen: dict[object, Path] = {}
    for path in paths:
        st = os.stat(path)
        keys = [(st.st_dev, st.st_ino)] + ([sha256_of(path)] if path.is_file() else [])
        for key, how in zip(keys, ("given twice", "holds the same bytes"), strict=False):
            if (first := seen.setdefault(key, path)) is not path:
                said = f"given twice (as {first} too)" if how == "given twice" else f"holds the same bytes as {first}"
                raise ConfigError(f"--ckpt {path}: {said}: it would weigh twice in the average")


def _read(path: Path | CheckpointSource):
    """The model at ``path``, located once (a run's steps are located already)."""
    return load_model_file(path if isinstance(path, CheckpointSource) else locate(path, _stderr))


def main(args: argparse.Namespace) -> int:
    if args.run_dir is not None:
        if STEP_DIR.match(Path(args.run_dir).name):
            run = Path(args.run_dir).parent.parent
            raise ConfigError(
                f"--run-dir {args.run_dir}: is one checkpoint (a step directory), not a run: name the checkpoints "
                f"to average with --ckpt, or their run with --run-dir {run}"
            )
        paths = _run_paths(args.run_dir, args.last)
    else:
        if args.last is not None:
            raise ConfigError("--last goes with --run-dir, not with --ckpt")
        paths = [Path(p) for p in args.ckpt]
        _refuse_twice(paths)
    _check_out(Path(args.out), paths, args.force)
    model = average_checkpoints(paths, load=_read)
    try:
        save_consolidated(args.out, model)
    except OSError as err:
        raise CheckpointError(f"{args.out}: cannot write ({err.strerror or err})") from None
    print(
        f"averaged {len(paths)} model{'s' * (len(paths) != 1)} (steps {model.meta['averaged_steps']}) into {args.out}",
        file=sys.stderr,
    )
    return 0
