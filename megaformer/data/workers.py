"""Loader workers of the token stream: they read shard runs and decode samples, nothing else.

A *run* is the part of one shard that a rank reads in an epoch: ``(shard, wanted
positions)``. Workers read disjoint runs, so no tar header is parsed twice, and send the
decoded samples to the rank's main process in chunks (:class:`Chunk`, four flat arrays:
cheap to pickle), each tagged with its epoch; a worker ends each epoch with an
:class:`EpochEnd`. Workers persist across epochs: after the epoch the stream started in,
a worker computes the next epoch's read order from the lengths (:func:`rank_read`, a pure
function) and reads its share of it, so no process is started at an epoch boundary. A
DataError met in a worker travels as a value (:class:`Failure`). What a worker decodes is
checked there: each shard's bytes against the manifest's sha256 as they stream, and every
token id against the vocabulary.

Workers ignore the signals the trainer handles (:func:`ignore_trainer_signals`), and
are started with those signals blocked (:func:`start_workers`).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import resource_tracker

import numpy as np
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from megaformer.data.plan import PlanSettings, rank_read
from megaformer.data.shards import PreparedSplit, read_shard
from megaformer.errors import DataError


@dataclass(frozen=True)
class Chunk:
    """Decoded samples of one epoch travelling from a worker to the main process as four flat arrays."""

    epoch: int
    ids: np.ndarray
    lengths: np.ndarray  # (n, 2)
    src: np.ndarray
    tgt: np.ndarray

    @staticmethod
    def pack(epoch: int, samples: list[tuple[int, np.ndarray, np.ndarray]]) -> Chunk:
        return Chunk(
            epoch,
            np.fromiter((i for i, _, _ in samples), dtype=np.int64, count=len(samples)),
            np.array([(len(s), len(t)) for _, s, t in samples], dtype=np.int64).reshape(-1, 2),
            np.concatenate([s for _, s, _ in samples]),
            np.concatenate([t for _, _, t in samples]),
        )

    def unpack(self) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        srcs = np.split(self.src, np.cumsum(self.lengths[:-1, 0]))
        tgts = np.split(self.tgt, np.cumsum(self.lengths[:-1, 1]))
        return zip(self.ids.tolist(), srcs, tgts)


@dataclass(frozen=True)
class EpochEnd:
    """A worker has sent every sample of ``epoch`` it reads."""

    epoch: int


@dataclass(frozen=True)
class Failure:
    """A DataError met in a worker, sent as a value (a raised one reaches the main process with a traceback)."""

    message: str


def as_is(item: object) -> object:
    return item


def ignore_trainer_signals(worker_id: int = 0, parent: int | None = None) -> None:
    """DataLoader ``worker_init_fn``: a worker ignores the signals the trainer handles (USR1, TERM, INT).

    ``scancel --signal=USR1``, SLURM's step signals and Ctrl-C reach every process of a job; a
    worker that kept USR1's or TERM's default action would die (one that took INT would end its
    loop) and take its rank down instead of letting the rank save (and requeue). A SIGTERM from
    the worker's own rank is still obeyed: that is how the rank's DataLoader and multiprocessing
    stop workers at exit. Python handlers cannot see a signal's sender, so SIGTERM is blocked and
    a thread reads it with ``sigtimedwait``, exiting only when the sender is the parent. A worker
    whose rank is gone (``kill -9``, the OOM killer) exits within a second: its loop would stop,
    but its queue's writer stays blocked on a pipe nobody reads, and the orphan would hold its
    memory, and any output pipe, for good. ``parent``: the rank's pid, given by the rank (a
    worker that read its parent itself after the rank died would take init for it).
    """
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    parent = os.getppid() if parent is None else parent

    def obey_parent_only() -> None:
        while True:
            info = signal.sigtimedwait({signal.SIGTERM}, 1.0)
            if (info is not None and info.si_pid == parent) or os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=obey_parent_only, name="sigterm-from-parent", daemon=True).start()


def start_workers(loader: DataLoader) -> Iterator:
    """``iter(loader)`` with USR1, TERM and INT blocked while its workers start.

    A rank's workers are spawned (the launcher's start method is inherited), and a spawned
    process begins with the default actions, which for USR1 and TERM kill it, until
    ``ignore_trainer_signals`` runs after its imports, seconds later. A blocked mask survives
    fork and exec, so a worker started under it holds a group-wide signal until the
    ``worker_init_fn`` ignores (USR1) or screens (TERM) it. The rank's own pending signals
    arrive when the mask is restored. Python's resource tracker, if it starts here, inherits
    the mask too, but unblocks TERM in this thread after it started, so the mask is set again.
    """
    screened = {signal.SIGUSR1, signal.SIGTERM, signal.SIGINT}
    held = signal.pthread_sigmask(signal.SIG_BLOCK, screened)
    try:
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, screened)
        return iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


class RunReader(IterableDataset):
    """Reads shard runs ``w, w + W, ...`` (worker ``w`` of ``W``) of each epoch; yields their samples in chunks.

    ``first_runs`` are the runs of ``first_epoch`` (what the stream's position still
    needs of it). With ``repeat`` a worker goes on to the following epochs, each the
    rank's whole share (:func:`rank_read` of ``settings`` and ``dp_rank``).
    """

    def __init__(
        self,
        data: PreparedSplit,
        first_epoch: int,
        first_runs: list[tuple[int, np.ndarray]],
        settings: PlanSettings,
        dp_rank: int,
        *,
        repeat: bool = False,
        verify: bool = True,
        chunk: int = 512,
    ) -> None:
        self.data, self.first_epoch, self.first_runs = data, first_epoch, first_runs
        self.settings, self.dp_rank, self.repeat = settings, dp_rank, repeat
        self.verify, self.chunk = verify, chunk

    def __iter__(self) -> Iterator[Chunk | EpochEnd | Failure]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        epoch, runs = self.first_epoch, self.first_runs
        try:
            while True:
                for shard, wanted in runs[worker::workers]:
                    yield from self._read(epoch, shard, wanted)
                yield EpochEnd(epoch)
                if not self.repeat:
                    return
                epoch += 1
                runs = shard_runs(self.data, rank_read(self.data, self.settings, epoch, self.dp_rank))
        except DataError as err:
            yield Failure(str(err))

    def _read(self, epoch: int, shard: int, wanted: np.ndarray) -> Iterator[Chunk]:
        url, offset = self.data.urls[shard], int(self.data.offsets[shard])
        sha256 = self.data.sha256_of_shard(shard) if self.verify else None
        samples = []
        for position, src, tgt in read_shard(url, wanted=wanted, expected=self.data.shard_sizes[shard], sha256=sha256):
            samples.append((offset + position, src, tgt))
            if len(samples) == self.chunk:
                yield self._checked(epoch, samples, url)
                samples = []
        if samples:
            yield self._checked(epoch, samples, url)

    def _checked(self, epoch: int, samples: list[tuple[int, np.ndarray, np.ndarray]], url: str) -> Chunk:
        """The samples as a chunk, their token ids checked against the vocabulary (once per chunk)."""
        chunk = Chunk.pack(epoch, samples)
        self.data.check_ids(chunk.src, f"{url} (source side)")
        self.data.check_ids(chunk.tgt, f"{url} (target side)")
        return chunk


def shard_runs(data: PreparedSplit, read: np.ndarray, needed: np.ndarray | None = None) -> list[tuple[int, np.ndarray]]:
    """The shard runs of a rank's read order that hold needed samples (default: all), in read order."""
    ids = read if needed is None else read[needed[read]]
    if len(ids) == 0:
        return []
    offsets = data.offsets
    shard_of = np.searchsorted(offsets, ids, side="right") - 1
    starts = np.flatnonzero(np.diff(shard_of, prepend=-1))
    runs = []
    for a, b in zip(starts, list(starts[1:]) + [len(ids)]):
        shard = int(shard_of[a])
        wanted = np.zeros(data.shard_sizes[shard], dtype=bool)
        wanted[ids[a:b] - offsets[shard]] = True
        runs.append((shard, wanted))
    return runs
