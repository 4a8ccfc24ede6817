"""Stream prepared shards as length-grouped token batches: split by DP rank, resumable.

**The epoch plan** (:mod:`megaformer.data.plan`). Before an epoch starts, every process
computes the same plan from the lengths index alone: which samples form which batch,
for every DP rank, every sample in exactly one batch of one rank.

**Workers** (:mod:`megaformer.data.workers`). Loader workers read and decode; they do not decide anything. The shards
a rank reads in an epoch (one *run* per shard: the part of it in the rank's share) are
dealt to the workers in turn, so no tar header is parsed twice; workers send decoded
samples in chunks to the main process, which pads them into the planned batches and
hands those out in plan order, holding about one sort window of decoded samples. So
the batches do not depend on the number of workers (a rank reading fewer shards than
it has workers just leaves some idle), and the stream's position is two numbers,
``(epoch, batches)``.

**Resume.** :meth:`TokenBatchStream.state_dict` holds that position and the settings the
plan was made with. Loading it continues with exactly the batches that would have come
next (any worker count). If the settings changed (another DP size, ``max_tokens``...),
the samples the old ranks had not yet consumed in that epoch are planned again with
the new settings, so that epoch still sees every sample once; later epochs use the new
settings throughout. This assumes, as synchronous data-parallel training guarantees,
that every DP rank had consumed the same number of batches.

**Checks.** What a worker decodes is checked as it streams: each shard's bytes against
the manifest's sha256 (hashed as the tar is read; ``verify=False`` skips it), every token
id against the vocabulary, and every sample's lengths against the lengths index the plan
was made from. A mismatch is a DataError naming the file.

Tensor-parallel peers pass the same ``dp_rank`` and receive identical batches.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from megaformer.config import DataConfig
from megaformer.data.plan import PlanSettings, RankPlan, padding_waste, plan_epoch
from megaformer.data.readahead import ReadAhead, SampleStore
from megaformer.data.shards import PreparedSplit, open_prepared, scan_shards, shard_urls
from megaformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from megaformer.data.workers import Chunk, RunReader, as_is, ignore_trainer_signals, shard_runs, start_workers
from megaformer.errors import ConfigError, DataError, MegaformerWarning

READ_AHEAD_BATCHES = 8  # collated batches kept ready by the read-ahead thread (a step's micro-batches, and more)

__all__ = [
    "Batch", "TokenBatchStream", "PlanSettings", "RankPlan", "plan_epoch", "padding_waste", "collate",
    # Re-exported from megaformer.data.shards: opening what the stream reads.
    "PreparedSplit", "open_prepared", "scan_shards", "shard_urls",
]  # fmt: skip


@dataclass
class Batch:
    """One micro-batch, ready for the model.

    ``ids`` are the samples' indices in their split (for valid/test: the line number,
    0-based), so that translations can be put back in corpus order.
    """

    src: torch.LongTensor  # (batch, src_len), right-padded with pad_id, each row ends with eos
    tgt_in: torch.LongTensor  # (batch, tgt_len), bos + target ids, padded
    tgt_out: torch.LongTensor  # (batch, tgt_len), target ids + eos, padded
    src_tokens: int  # non-pad tokens in src
    tgt_tokens: int  # non-pad tokens in tgt_out
    ids: torch.LongTensor | None = None  # (batch,) sample indices in the split

    def __len__(self) -> int:
        return self.src.shape[0]

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        return dataclasses.replace(
            self,
            src=fn(self.src),
            tgt_in=fn(self.tgt_in),
            tgt_out=fn(self.tgt_out),
            ids=None if self.ids is None else fn(self.ids),
        )

    def to(self, device: torch.device | str, non_blocking: bool | None = None) -> Batch:
        """The batch on ``device``; by default the copy does not block when the batch is pinned.

        A pinned batch (:meth:`pin_memory`, or a stream made with ``pin_memory=True``) is
        copied to a GPU asynchronously: the host goes on (collating the next batch) while
        the copy runs, and the GPU orders it before the kernels that read it. Pinned host
        memory is only reused once the copy is done (torch's caching host allocator).
        """
        if non_blocking is None:
            non_blocking = torch.device(device).type == "cuda" and self.src.is_pinned()
        return self._apply(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        """The batch in page-locked host memory, from which a GPU copies without a staging copy."""
        return self._apply(torch.Tensor.pin_memory)


# ---------------------------------------------------------------------------------------
# Reading samples (inside loader workers) and building batches (in the main process).


def collate(
    pairs: Sequence[tuple[np.ndarray, np.ndarray]], ids: np.ndarray, pad_id: int, bos_id: int, eos_id: int
) -> Batch:
    """Pad source and target ids into a :class:`Batch` (src + eos; bos + tgt; tgt + eos)."""
    src_len = np.fromiter((len(s) for s, _ in pairs), dtype=np.int64, count=len(pairs))
    tgt_len = np.fromiter((len(t) for _, t in pairs), dtype=np.int64, count=len(pairs))
    rows = np.arange(len(pairs))
    src = np.full((len(pairs), int(src_len.max()) + 1), pad_id, dtype=np.int64)
    src[np.arange(src.shape[1]) < src_len[:, None]] = np.concatenate([s for s, _ in pairs])
    src[rows, src_len] = eos_id
    width = int(tgt_len.max()) + 1
    tgt_ids = np.concatenate([t for _, t in pairs])
    tgt_in = np.full((len(pairs), width), pad_id, dtype=np.int64)
    tgt_in[:, 0] = bos_id
    tgt_in[:, 1:][np.arange(width - 1) < tgt_len[:, None]] = tgt_ids
    tgt_out = np.full((len(pairs), width), pad_id, dtype=np.int64)
    tgt_out[np.arange(width) < tgt_len[:, None]] = tgt_ids
    tgt_out[rows, tgt_len] = eos_id
    return Batch(
        torch.from_numpy(src),
        torch.from_numpy(tgt_in),
        torch.from_numpy(tgt_out),
        int(src_len.sum()) + len(pairs),
        int(tgt_len.sum()) + len(pairs),
        torch.from_numpy(ids.astype(np.int64)),
    )


# ---------------------------------------------------------------------------------------
# The stream.


def _is_shard_spec(source: str) -> bool:
    """Whether ``source`` names shards (a URL, a pipe, a brace pattern, a .tar) rather than a prepared directory."""
    return (
        "://" in source
        or source.startswith(("pipe:", "file:"))
        or "{" in source
        or "::" in source
        or (source.endswith((".tar", ".tgz", ".tar.gz")) and not Path(source).is_dir())
    )


class _PlanAhead:
    """The next epoch's plan, made in a thread while this epoch is handed out (``ahead``), or when asked for.

    A plan sorts every window of the rank's share: ~70 ms for 200,000 samples, seconds for WMT'14's
    4.5M, time the consumer would otherwise wait at the epoch boundary.
    """

    def __init__(self, plan_of: Callable[[int], RankPlan], ahead: bool) -> None:
        self._plan_of = plan_of
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="megaformer-plan") if ahead else None
        self._next: tuple[int, Future[RankPlan]] | None = None

    def start(self, epoch: int) -> None:
        if self._pool is not None and (self._next is None or self._next[0] != epoch):
            self._next = (epoch, self._pool.submit(self._plan_of, epoch))

    def get(self, epoch: int) -> RankPlan:
        if self._next is not None and self._next[0] == epoch:
            return self._next[1].result()
        return self._plan_of(epoch)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class TokenBatchStream:
    """Token-count batches of one split for one data-parallel rank; resumable.

    ``source``: a prepared directory (or its ``manifest.json``), a :class:`PreparedSplit`
    (from :func:`open_prepared`, e.g. with shards read from elsewhere), or shard URLs
    without a manifest (a webdataset spec or a list; they are read once to learn the
    lengths). ``spm`` checks a prepared directory against the tokenizer the caller uses.

    Iterating yields :class:`Batch` es from the current position: with ``repeat=True``
    (training) it never ends and moves on to the next epoch by itself; with
    ``repeat=False`` (evaluation) it ends with the current epoch and the next ``iter()``
    runs the following one. Handing out an epoch's last batch moves :attr:`epoch` on
    (and :attr:`position` back to 0). ``shuffle=False`` keeps shard order and length
    order (for evaluation). Use one iterator at a time: the position belongs to the stream.
    """

    def __init__(
        self,
        source: str | Path | Sequence[str] | PreparedSplit,
        split: str = "train",
        *,
        dp_rank: int,
        dp_size: int,
        max_tokens: int,
        num_workers: int = 0,
        shuffle_buffer: int = 10000,
        sort_buffer: int = 100000,
        seed: int = 0,
        pad_id: int = PAD_ID,
        bos_id: int = BOS_ID,
        eos_id: int = EOS_ID,
        max_len: int = 256,
        shuffle: bool = True,
        repeat: bool = True,
        epoch: int = 0,
        spm: str | Path | None = None,
        pin_memory: bool = False,
        verify: bool = True,
    ) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ConfigError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")
        if max_tokens < 1 or num_workers < 0 or epoch < 0:
            raise ConfigError(
                f"max_tokens must be >= 1, num_workers and epoch >= 0 (got {max_tokens}, {num_workers}, {epoch})"
            )
        if isinstance(source, PreparedSplit):
            self.data = source
        elif isinstance(source, (str, Path)) and not _is_shard_spec(str(source)):
            self.data = open_prepared(source, split, spm=spm)
        else:
            self.data = scan_shards(source, split)
        if self.data.manifest is not None and (pad_id, bos_id, eos_id) != self.data.special_ids:
            raise DataError(
                f"{self.data.manifest}: pad/bos/eos ids are {self.data.special_ids}, not {(pad_id, bos_id, eos_id)}"
            )
        self.split, self.dp_rank, self.num_workers, self.repeat = split, dp_rank, num_workers, repeat
        self.special_ids = (pad_id, bos_id, eos_id)
        self.pin_memory = pin_memory  # batches in page-locked memory, for asynchronous copies to a GPU
        self.verify = verify  # each shard's bytes checked against the manifest's sha256 as it streams
        self.settings = PlanSettings(dp_size, max_tokens, max_len, shuffle_buffer, sort_buffer, seed, shuffle)
        self._check_lengths()
        self._epoch, self._batches = epoch, 0
        self._history: list[tuple[PlanSettings, int]] = []  # earlier plans of this epoch (after a settings change)
        self._cached: tuple[tuple, RankPlan] | None = None

    @classmethod
    def from_config(
        cls,
        data: DataConfig,
        split: str,
        *,
        dp_rank: int,
        dp_size: int,
        shuffle: bool = True,
        repeat: bool = True,
        max_tokens: int = 0,
        pin_memory: bool = False,
    ) -> TokenBatchStream:
        """The stream of ``split`` of the prepared directory ``data.path``, with the sizes of ``data``.

        ``max_tokens``: the micro-batch size when not ``data.max_tokens`` (the step plan of
        :func:`megaformer.data.batching.plan_step` may lower it); ``pin_memory``: on a GPU run.
        """
        return cls(
            data.path, split, dp_rank=dp_rank, dp_size=dp_size, max_tokens=max_tokens or data.max_tokens,
            num_workers=data.num_workers, shuffle_buffer=data.shuffle_buffer, sort_buffer=data.sort_buffer,
            seed=data.seed, max_len=data.max_len, shuffle=shuffle, repeat=repeat, pin_memory=pin_memory,
        )  # fmt: skip

    def _check_lengths(self) -> None:
        where = self.data.manifest or (self.data.urls[0] if self.data.urls else self.split)
        longest = self.data.lengths.max(axis=1, initial=0) if len(self.data.lengths) else np.zeros(0, np.int64)
        kept = longest <= self.settings.max_len if self.settings.max_len > 0 else np.ones(len(longest), dtype=bool)
        self.excluded = int((~kept).sum())
        if not len(longest):
            raise DataError(f"{where}: split {self.split} holds no sample: prepare it again with its text")
        if not kept.any():
            shortest = int(longest.min())
            raise DataError(
                f"{where}: split {self.split} has no sample to stream: all {len(longest):,} are longer than "
                f"data.max_len={self.settings.max_len} tokens (the shortest {shortest}): raise data.max_len, or "
                "prepare the split again"
            )
        if self.excluded:
            warnings.warn(
                f"{where}: {self.excluded} samples of split {self.split} are longer than max_len="
                f"{self.settings.max_len} tokens and are left out of every epoch",
                MegaformerWarning,
                stacklevel=3,
            )
        need, room = int(longest[kept].max()) + 1, self.settings.max_tokens
        if need > room:
            shorter = f", or set data.max_len to at most {room - 1} to leave longer samples out" if room > 1 else ""
            raise DataError(
                f"data.max_tokens={room} cannot hold the longest {self.split} sample ({need} tokens with eos): "
                f"raise data.max_tokens to at least {need}{shorter}"
            )

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        """Batches of the current epoch already handed out."""
        return self._batches

    def _plan(self) -> RankPlan:
        key = (self._epoch, self.settings, tuple(self._history))
        if self._cached is None or self._cached[0] != key:
            self._cached = (key, self._plan_of(self._epoch, self._history))
        return self._cached[1]

    def _plan_of(self, epoch: int, history: Sequence[tuple[PlanSettings, int]] = ()) -> RankPlan:
        """This rank's plan of ``epoch``, less what the earlier plans in ``history`` had handed out of it."""
        available = None
        for settings, consumed in history:
            used = np.zeros(len(self.data.lengths), dtype=bool)
            for plan in plan_epoch(self.data, settings, epoch, available):
                for batch in plan.batches[:consumed]:
                    used[batch] = True
            available = ~used if available is None else available & ~used
        return plan_epoch(self.data, self.settings, epoch, available)[self.dp_rank]

    def window_starts(self, epoch: int) -> list[int]:
        """The index of each sort window's first batch in a whole ``epoch`` (which waits for its window to be read)."""
        return self._plan_of(epoch).windows

    def batches_per_epoch(self) -> int:
        """Batches in the current epoch (the same on every DP rank)."""
        return len(self._plan().batches)

    def __iter__(self) -> Iterator[Batch]:
        plan = self._plan()
        if self._batches >= len(plan.batches):  # a position at an epoch's end (or an empty re-planned rest)
            self._next_epoch()
            if not self.repeat:
                return
            plan = self._plan()
        store = self._open(plan)
        threaded = self._workers() > 0
        planner = _PlanAhead(self._plan_of, threaded and self.repeat)
        items = self._assemble(store, plan, planner)
        if threaded:
            # Two windows and a shuffle's reach ahead, the next window decoded while this one is
            # consumed; an epoch shorter than a window is that window (else a small split would be
            # decoded hundreds of epochs ahead, the workers busy all the while).
            share = -(-len(self.data.lengths) // self.settings.dp_size)  # this rank's samples of an epoch
            limit = 2 * min(self.settings.sort_buffer, share) + min(self.settings.shuffle_buffer, share)
            items = ReadAhead(items, READ_AHEAD_BATCHES, lambda: store.held < limit and store.pull(), "megaformer-read")
        try:
            for epoch, index, last, batch in items:
                # Counted before the caller sees the batch: a checkpoint taken now resumes after it.
                if last:
                    self._next_epoch()
                else:
                    self._epoch, self._batches = epoch, index + 1
                yield batch
        finally:
            items.close()
            planner.close()

    def _next_epoch(self) -> None:
        self._epoch, self._batches, self._history = self._epoch + 1, 0, []

    def _workers(self) -> int:
        """Loader workers: none asked, or a rank reading fewer shards than that leaves the rest out."""
        return min(self.num_workers, max(1, len(self.data.shard_sizes) // self.settings.dp_size))

    def _open(self, plan: RankPlan) -> SampleStore:
        """The decoded samples from the current position on, read by loader workers (or in this process)."""
        needed = np.zeros(len(self.data.lengths), dtype=bool)
        needed[np.concatenate(plan.batches[self._batches :])] = True
        first = shard_runs(self.data, plan.read, needed)
        reader = RunReader(
            self.data, self._epoch, first, self.settings, self.dp_rank, repeat=self.repeat, verify=self.verify
        )
        workers = self._workers()
        if workers == 0:
            return SampleStore(iter(reader), 1, len(self.data.lengths), self._check_lengths_of)
        loader = DataLoader(
            reader,
            batch_size=None,
            num_workers=workers,
            collate_fn=as_is,
            prefetch_factor=4,
            worker_init_fn=functools.partial(ignore_trainer_signals, parent=os.getpid()),
        )
        return SampleStore(start_workers(loader), workers, len(self.data.lengths), self._check_lengths_of)

    def _assemble(
        self, store: SampleStore, plan: RankPlan, planner: _PlanAhead
    ) -> Iterator[tuple[int, int, bool, Batch]]:
        """``(epoch, index, last of its epoch, batch)`` in plan order from the current position on.

        A sort window (or what is left of it at the position) is read whole before its first
        batch, which may hold samples from anywhere in it.
        """
        epoch, start = self._epoch, self._batches
        try:
            while True:
                planner.start(epoch + 1)
                starts = sorted({start, *(w for w in plan.windows if w > start)}) + [len(plan.batches)]
                for begin, end in zip(starts, starts[1:]):
                    store.wait_for(epoch, np.concatenate(plan.batches[begin:end]), self.split)
                    for index in range(begin, end):
                        ids = plan.batches[index]
                        batch = collate(store.take(epoch, ids, self.split), ids, *self.special_ids)
                        if self.pin_memory:
                            batch = batch.pin_memory()
                        yield epoch, index, index + 1 == len(plan.batches), batch
                if not self.repeat:
                    return
                epoch, start = epoch + 1, 0
                plan = planner.get(epoch)
        finally:
            store.close()

    def _check_lengths_of(self, chunk: Chunk) -> None:
        """Decoded samples must have the lengths the plan was made from (the lengths index)."""
        planned = self.data.lengths[chunk.ids]
        if not np.array_equal(chunk.lengths, planned):
            bad = int(chunk.ids[np.flatnonzero((chunk.lengths != planned).any(axis=1))[0]])
            where = self.data.manifest.parent if self.data.manifest is not None else "the lengths"
            raise DataError(
                f"{where}: sample {bad} of split {self.split} has {tuple(chunk.lengths[chunk.ids == bad][0])} "
                f"tokens, the lengths index says {tuple(self.data.lengths[bad])}: the index and the shards "
                f"do not belong together; prepare the data again"
            )

    def state_dict(self) -> dict:
        """The position (epoch, batches handed out) and the plan settings; small and JSON-safe."""
        return {
            "version": 1,
            "split": self.split,
            "samples": len(self.data.lengths),
            "epoch": self._epoch,
            "batches": self._batches,
            "settings": dataclasses.asdict(self.settings),
            "history": [{"settings": dataclasses.asdict(s), "batches": n} for s, n in self._history],
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue where ``state`` was taken (see the module docstring for changed settings)."""
        try:
            if state["version"] != 1:
                raise DataError(f"stream state version {state['version']} is not supported")
            saved = PlanSettings(**state["settings"])
            history = [(PlanSettings(**h["settings"]), int(h["batches"])) for h in state["history"]]
            epoch, batches = int(state["epoch"]), int(state["batches"])
        except (KeyError, TypeError) as err:
            raise DataError(f"not a stream state (missing or wrong {err})") from None
        if state["split"] != self.split or state["samples"] != len(self.data.lengths):
            where = self.data.manifest or (self.data.urls[0] if self.data.urls else self.split)
            raise DataError(
                f"{where}: split {self.split} holds {len(self.data.lengths):,} samples, and the checkpoint's data "
                f"position is in split {state['split']} of {state['samples']:,}: resume on the data it was trained "
                f"on (data.path), or start a new run in another --run-dir"
            )
        if saved == self.settings:
            self._history, self._batches = history, batches
        else:
            self._history, self._batches = history + [(saved, batches)], 0
        self._epoch = epoch
