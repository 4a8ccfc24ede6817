"""Starting a training run: the checks before any process starts, the run directory's lock, one rank's training.

:mod:`megaformer.commands.train` (``megaformer train``) checks its options and calls
:func:`check_launch` and :func:`launch` inside :func:`launch_scope`. Under torchrun, srun
or the DeepSpeed launcher this process is one rank; otherwise it holds the run
directory's lock and trains alone or starts ``world`` local ranks (``launcher.local``).
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from megaformer.config import Config, check_precision
from megaformer.errors import ConfigError, MegaformerWarning
from megaformer.logs import configure as configure_logs
from megaformer.logs import log_to_file, set_rank

if TYPE_CHECKING:
    from megaformer.parallel import ParallelLayout
    from megaformer.train.run_lock import RunLock


def run_lock(run_dir: str) -> RunLock:
    """The run directory's lock for this process (its SLURM job id, if any, lets a requeued job take it over)."""
    from launcher.env import slurm_job
    from megaformer.train.run_lock import RunLock

    return RunLock(Path(run_dir), slurm_job()[0])


def rank_main(cfg: Config, run_dir: str, resume: str, other_tokenizer: bool, locked: bool = False) -> int:
    """One rank's training. ``locked``: the launching process holds the run directory's lock for the ranks."""
    from launcher.env import detect, slurm_job
    from megaformer.parallel import ParallelContext
    from megaformer.train.trainer import Trainer

    info = detect()
    info.export()
    configure_logs()  # at the level the CLI chose (its environment, for ranks it started)
    set_rank(info.rank)
    if info.rank != 0:  # every rank reads the same data and settings: rank 0 says what they would say
        warnings.simplefilter("ignore", MegaformerWarning)
    with nullcontext() if locked or info.rank != 0 else run_lock(run_dir):  # rank 0 holds it for a launcher's ranks
        ctx = ParallelContext.initialize(
            cfg.parallel, info.rank, info.world_size, info.local_rank, single_process_group=True
        )
        log_to_file(Path(run_dir) / "logs" / f"rank-{info.rank}.log", info.rank)  # rank 0 holds the lock by now
        try:
            return Trainer(cfg, ctx, Path(run_dir), resume, other_tokenizer, slurm_job()[0]).train()
        finally:
            ctx.destroy()


def check_data(cfg: Config) -> None:
    """The prepared data must be there before any process starts (read_manifest names what is wrong)."""
    from megaformer.data.manifest import manifest_path, read_manifest

    if not cfg.data.path:
        raise ConfigError("data.path is empty: set it to a directory written by `megaformer prepare`")
    check_direction(cfg, read_manifest(manifest_path(cfg.data.path)), cfg.data.path)


def check_direction(cfg: Config, manifest: dict, where: str) -> None:
    """``data.src_lang`` and ``data.tgt_lang``, where given, are the prepared data's (a config for en->de on de->en
    data trained the other direction without a word)."""
    data = (manifest.get("src_lang"), manifest.get("tgt_lang"))
    for key, given, actual in zip(("src_lang", "tgt_lang"), (cfg.data.src_lang, cfg.data.tgt_lang), data, strict=True):
        if given and given != actual:
            wanted = (cfg.data.src_lang or data[0], cfg.data.tgt_lang or data[1])
            other = f", or prepare {wanted[0]} -> {wanted[1]} data" if wanted[0] != wanted[1] else ""
            raise ConfigError(
                f"data.{key}={given}: the data at {where} is {data[0]} -> {data[1]} (its manifest.json): set "
                f"data.src_lang={data[0]} data.tgt_lang={data[1]} (or leave them empty){other}"
            )


def check_launch(cfg: Config, world: int, per_node: list[int] | None = None) -> ParallelLayout:
    """Everything that can be refused before a process starts: the layout for ``world`` ranks (returned), the
    split, the data; with ``per_node`` (the ranks each node runs, numbered node by node), no TP group across
    nodes (the ranks check again on their host names)."""
    from megaformer.parallel import ParallelLayout, check_model_split, check_tp_within_nodes
    from megaformer.parallel.layout import lean_refusal

    layout = ParallelLayout.from_config(cfg.parallel, world)
    if per_node is not None:
        if sum(per_node) != world:
            raise ConfigError(f"--tasks-per-node: {sum(per_node)} processes on {len(per_node)} node(s), not {world}")
        check_tp_within_nodes(layout, [f"node{i}" for i, count in enumerate(per_node, 1) for _ in range(count)])
    check_model_split(cfg.model, layout.tp)
    check_precision(cfg.train)
    if cfg.train.optimizer == "lean" and (why := lean_refusal(cfg.train.precision, layout.dp, layout.pp)):
        raise ConfigError(why)
    check_data(cfg)
    return layout


RUN_FILES = ("metrics.jsonl", "config.yaml")  # what a run writes into its directory as files
RUN_FOLDERS = ("checkpoints", "tensorboard")


def check_run_dir(run_dir: str) -> None:
    """What the ranks will write into ``run_dir`` can be written: a file where a file goes, a folder where a folder
    goes (a ``metrics.jsonl`` folder passed ``train --check``, then stopped every rank). The lock is the lock's."""
    from megaformer.files import path_refusal

    for name, folder in [(n, False) for n in RUN_FILES] + [(n, True) for n in RUN_FOLDERS]:
        path = Path(run_dir) / name
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        except OSError as err:
            raise ConfigError(f"--run-dir {run_dir}: {name}: cannot be written: {path_refusal(path, err)}") from None
        if stat.S_ISDIR(st.st_mode) != folder:
            err = OSError(errno.ENOTDIR if folder else errno.EISDIR, "")
            why = f"{path}: is a file, expected a directory" if folder else path_refusal(path, err)
            raise ConfigError(f"--run-dir {run_dir}: {name}: cannot be written: {why}: move it away")


OVERSUBSCRIBE_FACTOR = 4
"""Local ranks allowed per core the process may run on: more only spin and swap (64 ranks on 2 cores took minutes
to start and trained nothing)."""
OVERSUBSCRIBE_ENV = "MEGAFORMER_OVERSUBSCRIBE"


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask: a container's or taskset's share, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_local_ranks(ranks: int, cores: int, allowed: bool) -> None:
    """Refuse ``ranks`` local ranks beyond ``OVERSUBSCRIBE_FACTOR`` per core unless ``allowed`` (``--oversubscribe``).

    The ranks share the cores' threads (``launcher.local`` gives each ``cores // ranks``, at least one), so ranks x
    threads exceeds the cores x factor exactly when the ranks do.
    """
    if allowed or ranks <= cores * OVERSUBSCRIBE_FACTOR:
        return
    raise ConfigError(
        f"--nproc: {ranks} processes on this machine's {cores} core{'s' * (cores != 1)} (at most "
        f"{OVERSUBSCRIBE_FACTOR} a core, {cores * OVERSUBSCRIBE_FACTOR}): lower --nproc (a job over several nodes: "
        f"say how many each runs with --tasks-per-node), or pass --oversubscribe (or set {OVERSUBSCRIBE_ENV}=1) "
        f"to start them anyway"
    )


def check_step_plan(cfg: Config, streams: int) -> None:
    """The step plan the ranks will make: each step's ``train.tokens_per_step`` over ``streams`` data streams,
    in micro-batches of at most ``data.max_tokens`` that hold ``data.max_len`` + 1 tokens."""
    from megaformer.data.batching import plan_step

    plan_step(cfg.train.tokens_per_step, streams, cfg.data.max_tokens, cfg.data.max_len + 1)


@contextmanager
def launch_scope() -> Iterator[None]:
    """USR1 held from here until the trainer handles it; the signal mask, TERM's handler and the launch variables
    restored after.

    A caller in this process gets its mask and environment back (a one-process run exports
    RANK, WORLD_SIZE, ... for env://, which a later command in the process would take as its launch).
    After a requeue in a SLURM job, TERM stays ignored (:meth:`SignalWatch.restore`): the process is
    ending, and SLURM's SIGTERM for the attempt may come after the command returned, while the
    interpreter shuts down.
    """
    from launcher.env import LAUNCH_VARIABLES
    from megaformer.train.signals import hold_signals

    held = hold_signals()  # a warning during start-up waits for the trainer instead of killing the rank
    term = signal.getsignal(signal.SIGTERM)
    launch_env = {name: os.environ.get(name) for name in LAUNCH_VARIABLES}
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:  # ignored by SignalWatch after a requeue
            signal.signal(signal.SIGTERM, term)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        for name, value in launch_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def launch(cfg: Config, run_dir: str, world: int, resume: str, other_tokenizer: bool, under_launcher: bool) -> int:
    """Train ``cfg`` into ``run_dir``: as one rank of a launcher's (``under_launcher``), or with ``world`` local ranks."""
    from launcher.local import spawn

    if under_launcher:
        return rank_main(cfg, run_dir, resume, other_tokenizer)
    with run_lock(run_dir):  # before anything is written into the run directory
        if world > 1:
            return spawn(rank_main, world, cfg, run_dir, resume, other_tokenizer, True)
        return rank_main(cfg, run_dir, resume, other_tokenizer, True)
