"""The epoch plan: which samples form which batch, for every DP rank; a pure function of the lengths.

**The epoch plan.** Before an epoch starts, every process computes the same *plan*
from the lengths index alone (no shard is opened); the plan fixes which samples form
which batch, for every DP rank:

1. shard order: the shards in a random order drawn from ``(seed, epoch)``;
2. rank share: the samples in that order cut into ``dp_size`` contiguous parts of
   equal size (+-1) - by sample index, not by shard, so fewer shards than ranks x
   workers still works, and each rank reads only ~1/dp of the data;
3. shuffle buffer: each sample moves up to ``shuffle_buffer`` places (seeded by
   ``(seed, epoch, rank)``);
4. batching: windows of ``sort_buffer`` consecutive samples are sorted by length (the
   longer side, then the side difference, ties broken at random), cut greedily into
   batches with ``batch * max_len_src <= max_tokens`` and ``batch * max_len_tgt <=
   max_tokens`` (lengths with eos / bos), and the window's batches are shuffled;
5. equal counts: a rank with fewer batches than the busiest rank splits its largest
   batches in two until the counts match. Collective training cannot hang on a rank
   that ran out of data (webdataset #194, #225), and no sample is dropped or repeated:
   every sample is in exactly one batch of one rank per epoch.

Samples longer than ``max_len`` tokens on either side are left out of every epoch (a
warning says how many); ``prepare`` normally filtered them already.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from megaformer.data.shards import PreparedSplit
from megaformer.errors import DataError, MegaformerWarning


@dataclass(frozen=True)
class PlanSettings:
    """Everything the batches of an epoch depend on (not the rank, not the worker count)."""

    dp_size: int
    max_tokens: int
    max_len: int
    shuffle_buffer: int
    sort_buffer: int
    seed: int
    shuffle: bool


@dataclass
class RankPlan:
    """One rank's epoch: ``read`` = sample ids in the order its shards are read; ``batches`` in order.

    ``windows``: the index of each sort window's first batch (a window's first batch needs the
    whole window read).
    """

    read: np.ndarray
    batches: list[np.ndarray]
    windows: list[int] = field(default_factory=list)


def _rng(*words: int) -> np.random.Generator:
    return np.random.default_rng([int(w) for w in words])


def _cut(order: np.ndarray, longest: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """Cut ``order`` (sorted so that ``longest`` never decreases) into the fewest greedy batches that fit."""
    batches, start, n = [], 0, len(order)
    while start < n:
        cap = min(n - start, max_tokens // int(longest[start]))
        # (k + 1) * longest[start + k] never decreases with k: the first k that overflows ends the batch.
        cost = np.arange(1, cap + 1) * longest[start : start + cap]
        size = max(1, int(np.searchsorted(cost, max_tokens, side="right")))
        batches.append(order[start : start + size])
        start += size
    return batches


def _rank_batches(ids: np.ndarray, lengths: np.ndarray, s: PlanSettings, epoch: int, rank: int) -> RankPlan:
    """Steps 3 and 4 of the plan for one rank's share ``ids`` (in read order)."""
    read = ids
    if s.shuffle and s.shuffle_buffer > 1:
        jitter = _rng(s.seed, epoch, rank, 1).random(len(ids)) * s.shuffle_buffer
        ids = ids[np.argsort(np.arange(len(ids)) + jitter, kind="stable")]
    plan = RankPlan(read, [])
    batches = plan.batches
    windows = max(1, -(-len(ids) // max(1, s.sort_buffer)))
    for w, window in enumerate(np.array_split(ids, windows)):
        if len(window) == 0:
            continue
        plan.windows.append(len(batches))
        rng = _rng(s.seed, epoch, rank, 2, w)
        src, tgt = lengths[window, 0] + 1, lengths[window, 1] + 1  # with eos (src) / bos or eos (tgt)
        longest, diff = np.maximum(src, tgt), tgt - src
        ties = rng.permutation(len(window)) if s.shuffle else np.arange(len(window))
        # Snake through the side difference (ascending for even lengths, descending for odd):
        # neighbours in this order are close in both lengths, so both sides pad little.
        order = np.lexsort((ties, np.where(longest % 2 == 0, diff, -diff), longest))
        cut = _cut(window[order], longest[order], s.max_tokens)
        batches.extend(cut[i] for i in (rng.permutation(len(cut)) if s.shuffle else range(len(cut))))
    return plan


def _equalize(plans: list[RankPlan], split: str) -> None:
    """Step 5: split the largest batches of the ranks that have fewer, until all counts match."""
    target = max(len(p.batches) for p in plans)
    for rank, plan in enumerate(plans):
        while len(plan.batches) < target:
            sizes = [len(b) for b in plan.batches]
            big = int(np.argmax(sizes)) if sizes else -1
            if big < 0 or sizes[big] < 2:
                raise DataError(
                    f"split {split}: rank {rank} has {len(plan.read)} samples, too few for {target} batches "
                    f"like the other ranks: use fewer data-parallel ranks or a smaller max_tokens"
                )
            half = len(plan.batches[big]) // 2
            plan.batches[big : big + 1] = [plan.batches[big][:half], plan.batches[big][half:]]
            plan.windows = [w + (w > big) for w in plan.windows]


def _read_order(data: PreparedSplit, s: PlanSettings, epoch: int, available: np.ndarray | None) -> np.ndarray:
    """Steps 1 and 2 before the cut: every kept sample of ``epoch`` in the order the shards are read."""
    shards = (
        _rng(s.seed, epoch, 0).permutation(len(data.shard_sizes)) if s.shuffle else np.arange(len(data.shard_sizes))
    )
    offsets = data.offsets
    order = (
        np.concatenate([np.arange(offsets[k], offsets[k + 1]) for k in shards])
        if len(shards)
        else np.zeros(0, np.int64)
    )
    keep = np.ones(len(data.lengths), dtype=bool) if available is None else available.copy()
    if s.max_len > 0:
        keep &= data.lengths.max(axis=1, initial=0) <= s.max_len
    return order[keep[order]]


def rank_read(data: PreparedSplit, s: PlanSettings, epoch: int, rank: int) -> np.ndarray:
    """``plan_epoch(data, s, epoch)[rank].read`` without batching: what a rank's loader workers read in an epoch."""
    return np.array_split(_read_order(data, s, epoch, None), s.dp_size)[rank]


def plan_epoch(data: PreparedSplit, s: PlanSettings, epoch: int, available: np.ndarray | None = None) -> list[RankPlan]:
    """The plan of every rank for ``epoch``; ``available`` (bool per sample) limits it to some samples."""
    lengths = data.lengths
    order = _read_order(data, s, epoch, available)
    if available is not None and len(order) < s.dp_size:
        # The rest of an epoch re-planned for more ranks than samples are left: it cannot give
        # every rank a batch, so those few samples wait for the next epoch.
        if len(order):
            warnings.warn(
                f"split {data.split}: the {len(order)} samples left in epoch {epoch} are fewer than "
                f"{s.dp_size} ranks and are skipped until the next epoch",
                MegaformerWarning,
                stacklevel=2,
            )
        return [RankPlan(order[:0], []) for _ in range(s.dp_size)]
    plans = [_rank_batches(part, lengths, s, epoch, rank) for rank, part in enumerate(np.array_split(order, s.dp_size))]
    _equalize(plans, data.split)
    return plans


def padding_waste(batches: Sequence[np.ndarray], lengths: np.ndarray) -> float:
    """Share of the token slots of ``batches`` (both sides, with eos/bos) that hold padding."""
    slots = real = 0
    for batch in batches:
        src, tgt = lengths[batch, 0] + 1, lengths[batch, 1] + 1
        slots += len(batch) * (int(src.max()) + int(tgt.max()))
        real += int(src.sum() + tgt.sum())
    return 1.0 - real / slots if slots else 0.0
