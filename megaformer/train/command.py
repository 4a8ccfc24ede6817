"""``megaformer train`` (``reshard`` is :mod:`megaformer.train.reshard_command`, ``export`` :mod:`megaformer.export.command`).

``train --resume`` keeps its own name: it is a policy (``auto``: the newest complete
checkpoint of the run directory, if any; ``none``: start fresh) that may also be a
checkpoint path, not only the checkpoint that every other command calls ``--ckpt``.
"""

from __future__ import annotations

import argparse
import os
import signal
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from megaformer.cli_args import existing_file, existing_path, new_dir, nonneg_int
from megaformer.config import Config, load_config
from megaformer.errors import ConfigError

if TYPE_CHECKING:
    from megaformer.train.run_lock import RunLock


def resume_policy(text: str) -> str:
    """``auto``, ``none`` or an existing checkpoint (step directory, checkpoints folder or run directory)."""
    return text if text in ("auto", "none") else existing_path(text)


resume_policy.checked_kind = "path"  # type: ignore[attr-defined]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=existing_file, required=True, help="YAML config, e.g. configs/transformer_big.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--run-dir",
        type=new_dir,
        default=None,
        help="where checkpoints, metrics and logs go (default: runs/<config name>)",
    )
    p.add_argument(
        "--resume",
        type=resume_policy,
        default="auto",
        help="auto: newest complete checkpoint in the run dir, if any; none: start fresh; or a checkpoint path",
    )
    p.add_argument(
        "--other-tokenizer",
        action="store_true",
        help="resume a checkpoint on data prepared with another tokenizer of the same size (refused otherwise)",
    )
    p.add_argument(
        "--nproc",
        type=nonneg_int,
        default=0,
        help="start this many local processes (gloo on a CPU) when not under torchrun/srun/deepspeed; 0 = one",
    )


def run_lock(run_dir: str) -> RunLock:
    """The run directory's lock for this process (its SLURM job id, if any, lets a requeued job take it over)."""
    from megaformer.train.run_lock import RunLock

    return RunLock(Path(run_dir), os.environ.get("SLURM_JOB_ID"))


def _rank_main(cfg: Config, run_dir: str, resume: str, other_tokenizer: bool, locked: bool = False) -> int:
    """One rank's training. ``locked``: the launching process holds the run directory's lock for the ranks."""
    from launcher.env import detect
    from megaformer.parallel import ParallelContext
    from megaformer.train.trainer import Trainer

    info = detect()
    info.export()
    with nullcontext() if locked or info.rank != 0 else run_lock(run_dir):  # rank 0 holds it for a launcher's ranks
        ctx = ParallelContext.initialize(
            cfg.parallel, info.rank, info.world_size, info.local_rank, single_process_group=True
        )
        try:
            return Trainer(cfg, ctx, Path(run_dir), resume, other_tokenizer).train()
        finally:
            ctx.destroy()


def _check_data(cfg: Config) -> None:
    """The prepared data must be there before any process starts (read_manifest names what is wrong)."""
    from megaformer.data.shards import manifest_path, read_manifest

    if not cfg.data.path:
        raise ConfigError("data.path is empty: set it to a directory written by `megaformer prepare`")
    read_manifest(manifest_path(cfg.data.path))


def main(args: argparse.Namespace) -> int:
    from launcher.env import LAUNCH_VARIABLES
    from megaformer.train.signals import hold_signals

    held = hold_signals()  # USR1/TERM during start-up wait for the trainer instead of killing the rank
    launch_env = {name: os.environ.get(name) for name in LAUNCH_VARIABLES}
    try:
        return _train(args)
    finally:
        # A caller in this process gets its mask and environment back (a one-process run exports
        # RANK, WORLD_SIZE, ... for env://, which a later command in the process would take as its launch).
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        for name, value in launch_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _train(args: argparse.Namespace) -> int:
    from launcher.env import detect
    from launcher.local import free_port, spawn
    from megaformer.parallel import ParallelLayout, check_model_split

    cfg = load_config(args.config, args.overrides)
    run_dir = args.run_dir or str(Path("runs") / Path(args.config).stem)
    if Path(run_dir).exists() and not Path(run_dir).is_dir():
        raise ConfigError(f"--run-dir {run_dir}: is a file, expected a directory")
    info = detect()
    world = args.nproc if info.source == "single" and args.nproc > 0 else info.world_size
    if info.source != "single" and args.nproc > 0 and args.nproc != info.world_size:
        raise ConfigError(
            f"--nproc {args.nproc} under {info.source}, which started {info.world_size} processes: drop --nproc"
        )
    from megaformer.train.engine import check_precision

    layout = ParallelLayout.from_config(cfg.parallel, world)  # fail before any process starts
    check_model_split(cfg.model, layout.tp)
    check_precision(cfg.train)
    _check_data(cfg)
    if info.source != "single":
        return _rank_main(cfg, run_dir, args.resume, args.other_tokenizer)
    with run_lock(run_dir):  # before anything is written into the run directory
        if world > 1:
            return spawn(_rank_main, world, cfg, run_dir, args.resume, args.other_tokenizer, True)
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        return _rank_main(cfg, run_dir, args.resume, args.other_tokenizer, True)
