"""``megaformer train``: check the options, then :func:`megaformer.train.launch.launch`.

``train --resume`` keeps its own name: it is a policy (``auto``: the newest complete
checkpoint of the run directory, if any; ``none``: start fresh) that may also be a
checkpoint path, not only the checkpoint that every other command calls ``--ckpt``.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from megaformer.checkpoint.format import POINTERS, checkpoint_root, list_checkpoints, read_pointer
from megaformer.checkpoint.meta import read_meta, saved_streams, slurm_job_of
from megaformer.cli_args import existing_file, existing_path, new_dir, nonneg_int
from megaformer.config import Config, load_config
from megaformer.errors import ConfigError

LOG = logging.getLogger(__name__)

if TYPE_CHECKING:
    from megaformer.parallel import ParallelLayout


def resume_policy(text: str) -> str:
    """``auto``, ``none`` or an existing checkpoint (step directory, checkpoints folder or run directory)."""
    return text if text in ("auto", "none") else existing_path(text)


resume_policy.checked_kind = "path"  # type: ignore[attr-defined]


def tasks_per_node(text: str) -> list[int]:
    """SLURM's ``2(x3),1`` form, as a list of counts."""
    from launcher.env import parse_tasks_per_node

    try:
        return parse_tasks_per_node(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


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
    p.add_argument(
        "--oversubscribe",
        action="store_true",
        help="start --nproc processes even beyond 4 a core (refused otherwise; or set MEGAFORMER_OVERSUBSCRIBE=1)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="check the config, the layout for --nproc processes, the data and the run directory (not held by "
        "another training), say what would run, and exit without training",
    )
    p.add_argument(
        "--tasks-per-node",
        type=tasks_per_node,
        default=None,
        metavar="SPEC",
        help="with --check: how many of the processes each node runs, in SLURM's form (2(x4),1), ranks numbered "
        "node by node: tensor-parallel groups must not span nodes (slurm/common.sh passes the job's)",
    )


def main(args: argparse.Namespace) -> int:
    from megaformer.train.launch import launch_scope

    with launch_scope():
        return _train(args)


def _train(args: argparse.Namespace) -> int:
    from launcher.env import detect, slurm_job
    from megaformer.train.launch import (
        OVERSUBSCRIBE_ENV,
        check_launch,
        check_local_ranks,
        check_run_dir,
        check_step_plan,
        launch,
        usable_cores,
    )

    cfg = load_config(args.config, args.overrides)
    run_dir = args.run_dir or str(Path("runs") / Path(args.config).stem)
    try:
        new_dir(run_dir)  # --run-dir's checks, for the default run directory too
    except argparse.ArgumentTypeError as err:
        raise ConfigError(f"--run-dir {err}") from None
    info = detect()
    say = LOG.info if info.rank == 0 and not args.check else lambda line: None  # a check's ranks say it when they run
    resume = _resume_in(Path(run_dir), args.resume, say, slurm_job())
    world = args.nproc if info.source == "single" and args.nproc > 0 else info.world_size
    if info.source != "single" and args.nproc > 0 and args.nproc != info.world_size:
        raise ConfigError(
            f"--nproc {args.nproc} under {info.source}, which started {info.world_size} processes: drop --nproc"
        )
    if info.source == "single":  # local ranks on this machine's cores (a node's, for a job's --check)
        here = max(args.tasks_per_node) if args.tasks_per_node else world
        check_local_ranks(here, usable_cores(), args.oversubscribe or os.environ.get(OVERSUBSCRIBE_ENV) == "1")
    if args.tasks_per_node is not None and not args.check:
        raise ConfigError("--tasks-per-node describes the nodes for --check, which it comes with: add --check")
    layout = check_launch(cfg, world, args.tasks_per_node)  # fail before any process starts
    check_run_dir(run_dir)
    if (streams := _planned_streams(Path(run_dir), resume, layout.dp)) is not None:
        check_step_plan(cfg, streams)
    if args.check:
        return _checked(cfg, run_dir, layout, resume)
    return launch(cfg, run_dir, world, resume, args.other_tokenizer, under_launcher=info.source != "single")


def _checked(cfg: Config, run_dir: str, layout: ParallelLayout, resume: str) -> int:
    """``--check``: the run directory is free too; one line says what would run (slurm/common.sh, before srun)."""
    from megaformer.train.launch import run_lock

    world = layout.world_size
    run_lock(run_dir).check_free()
    processes = f"{world} process{'es' if world > 1 else ''}"
    print(
        f"train: checked: {processes} (tp={layout.tp} dp={layout.dp} pp={layout.pp}), data {cfg.data.path}, "
        f"run dir {run_dir} (resume {resume}): nothing started"
    )
    return 0


def _planned_streams(run_dir: Path, resume: str, dp: int) -> int | None:
    """The data streams the ranks will plan the steps for: ``dp`` for a run that starts anew, else as the newest
    checkpoint it resumes keeps them (its meta.json); None where that cannot be read here (the ranks then say why).
    """
    from megaformer.data.batching import stream_count

    if resume == "none":
        return dp
    source = run_dir if resume == "auto" else Path(resume)
    try:
        if source.is_file() and source.name in POINTERS:  # a pointer: the step it names, beside it
            if (name := read_pointer(source)) is None:
                return None
            source = source.parent / name
        steps = [source] if (source / "meta.json").is_file() else list_checkpoints(checkpoint_root(source))
        if not steps:
            return dp if resume == "auto" else None
        saved = saved_streams(read_meta(steps[0]))
    except (OSError, ValueError):
        return None
    return stream_count(saved, dp) if saved is not None else None


def _saved_by(step_dir: Path, job: str | None) -> bool:
    """Whether SLURM job ``job`` saved ``step_dir`` (its meta.json says so; read with json alone: no torch here)."""
    try:
        return job is not None and slurm_job_of(read_meta(step_dir)) == job
    except (OSError, ValueError):
        return False


def _resume_in(run_dir: Path, resume: str, say, job: tuple[str | None, int] = (None, 0)) -> str:
    """The resume policy for ``run_dir``, as fairseq's ``--restore-file``: a checkpoint given (``--resume PATH``)
    starts the run only while the run directory holds none of its own; once the run has saved, a restart (a
    requeued SLURM job runs the same command) continues the run's own newest (``auto``), said in one line.

    ``--resume none`` into a run directory that holds checkpoints is refused: the new run's saves would mix
    with the earlier run's (pruning would delete the new ones first, ``--resume auto``, ``average`` and
    ``translate`` would take the old newest) and its metrics would replace theirs. A requeued SLURM job
    (``job``: its id and restart count) whose newest checkpoint it saved itself (meta.json's ``slurm_job``)
    continues it: the run is its own, which its requeue must not end. A model file or an export
    as ``--resume`` is refused: it holds no training state.

    The launching process imports no torch (launcher.local): megaformer.checkpoint.format is json and pathlib.
    """
    if resume == "auto":
        return resume
    given = Path(resume)
    if (given.is_file() and given.name not in POINTERS) or (given / "megaformer-export.json").is_file():
        raise ConfigError(
            f"--resume {resume}: is a model file or export, which holds no training state: resume from a step "
            f"directory (RUN/checkpoints/step-N) or a run directory; translate, evaluate and export read model files"
        )
    steps = [p.name for p in list_checkpoints(run_dir / "checkpoints")]
    if not steps:
        return resume
    if resume == "none" and job[1] and _saved_by(run_dir / "checkpoints" / steps[0], job[0]):
        say(
            f"train: --resume none is not used: this is restart {job[1]} of SLURM job {job[0]}, whose earlier "
            f"attempts saved {run_dir}'s checkpoints (newest {steps[0]}), which it continues"
        )
        return "auto"
    if resume == "none":
        raise ConfigError(
            f"--run-dir {run_dir}: holds an earlier run's checkpoints (newest {steps[0]}), which --resume none "
            f"would mix with this run's: continue it (--resume auto), train into another --run-dir, or delete "
            f"{run_dir / 'checkpoints'} first"
        )
    if given.resolve().is_relative_to(run_dir.resolve()):  # a step back in its own run
        return resume
    say(
        f"train: --resume {resume} is not used: {run_dir} holds this run's own checkpoints (newest {steps[0]}), "
        f"which it continues (a restarted or requeued job goes on where it stopped); to start from {resume}, "
        f"train into another --run-dir"
    )
    return "auto"
