"""``megaformer train``, ``megaformer reshard`` and ``megaformer export``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from megaformer.config import Config, load_config
from megaformer.errors import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML config, e.g. configs/transformer_big.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--run-dir", default=None, help="where checkpoints, metrics and logs go (default: runs/<config name>)"
    )
    p.add_argument(
        "--resume",
        default="auto",
        help="auto: newest complete checkpoint in the run dir, if any; none: start fresh; or a checkpoint path",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=0,
        help="start this many local processes (gloo on a CPU) when not under torchrun/srun/deepspeed",
    )


def _rank_main(cfg: Config, run_dir: str, resume: str) -> int:
    from launcher.env import detect
    from megaformer.parallel import ParallelContext
    from megaformer.train.trainer import Trainer

    info = detect()
    info.export()
    ctx = ParallelContext.initialize(
        cfg.parallel, info.rank, info.world_size, info.local_rank, single_process_group=True
    )
    try:
        return Trainer(cfg, ctx, Path(run_dir), resume).train()
    finally:
        ctx.destroy()


def main(args: argparse.Namespace) -> int:
    from launcher.env import detect
    from launcher.local import free_port, spawn
    from megaformer.parallel import ParallelLayout
    from megaformer.train.signals import hold_signals

    hold_signals()  # USR1/TERM during start-up wait for the trainer instead of killing the rank

    cfg = load_config(args.config, args.overrides)
    run_dir = args.run_dir or str(Path("runs") / Path(args.config).stem)
    info = detect()
    world = args.nproc if info.source == "single" and args.nproc > 0 else info.world_size
    if info.source != "single" and args.nproc > 0 and args.nproc != info.world_size:
        raise ConfigError(
            f"--nproc {args.nproc} under {info.source}, which started {info.world_size} processes: drop --nproc"
        )
    from megaformer.train.engine import check_precision

    layout = ParallelLayout.from_config(cfg.parallel, world)  # fail before any process starts
    layout.validate_model(cfg.model)
    check_precision(cfg.train)
    if info.source == "single" and world > 1:
        return spawn(_rank_main, world, cfg, run_dir, args.resume)
    if info.source == "single":
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    return _rank_main(cfg, run_dir, args.resume)


# ---- reshard / export -------------------------------------------------------------------------


def add_reshard_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--in", dest="src", required=True, help="checkpoint step directory or run directory")
    p.add_argument("--out", required=True, help="output checkpoints folder (or step directory)")
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel size of the output")


def reshard_main(args: argparse.Namespace) -> int:
    from megaformer.train.checkpoint import reshard

    out = reshard(Path(args.src), Path(args.out), args.tp)
    print(f"reshard: wrote {out} for tp={args.tp}")
    return 0


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt", required=True, help="checkpoint step directory or run directory")
    p.add_argument("--out", required=True, help="consolidated model file to write")


def export_main(args: argparse.Namespace) -> int:
    from megaformer.train.checkpoint import consolidate, resolve_checkpoint, save_consolidated

    step_dir = resolve_checkpoint(Path(args.ckpt), log=lambda m: print(m, file=sys.stderr))
    model = consolidate(step_dir)
    save_consolidated(args.out, model)
    n = sum(t.numel() for t in model.model.values())
    print(f"export: wrote {args.out} from {step_dir} ({n:,} values, step {model.meta['step']})")
    return 0
