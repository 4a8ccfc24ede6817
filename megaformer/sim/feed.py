"""The feed's share of a step: the host's time to hand over a step's micro-batches, measured on this CPU.

A step begins with :meth:`megaformer.train.feed.DataFeed.next_step` on the thread that then dispatches
the step. What it costs that thread is not an aten operator, so :func:`megaformer.sim.step.record_step`
does not see it: it is measured here by running the Trainer's own feed (the step plan, the streams,
the loader workers of ``data.num_workers``) over a prepared corpus for a number of steps, with no
model. The figure is the CPU time of this process per step (``time.process_time``: the calling
thread and the stream's own threads, which share its interpreter lock with the dispatch), not the
wall time: a loader worker decodes in its own process, beside the step, and only the main process's
work delays the dispatch.

``restart_each_epoch`` models the feed of the tree at ``ba234f9`` (the 2026-11-30 H200 run), which
started a new loader at every epoch and waited for it to decode a whole sort window before the
epoch's first batch, between two steps: a fresh stream each epoch with no workers does that same
decoding on the calling thread. Pinning each batch (a GPU run's page-locked copies) needs CUDA and
is left out.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

from megaformer.config import Config
from megaformer.data.batching import plan_step
from megaformer.data.stream import Batch, TokenBatchStream
from megaformer.sim.ops import Op


@dataclasses.dataclass(frozen=True)
class FeedCost:
    """The feed of ``steps`` steps: this process's CPU seconds (the mean, epoch starts included, and the median
    step's, a step within an epoch) and the wall seconds, each per step."""

    cpu_s: float
    steady_cpu_s: float
    wall_s: float
    steps: int
    epochs: int  # epochs begun within the timed steps
    target_tokens: float  # per step

    def seconds_for(self, target_tokens: float, steady: bool = False) -> float:
        """This process's CPU seconds to feed a step of ``target_tokens`` (the cost scales with the tokens): on
        average, or (``steady``) a step that starts no epoch."""
        return (self.steady_cpu_s if steady else self.cpu_s) * target_tokens / self.target_tokens


def feed_cost(cfg: Config, data: Path, steps: int = 20, warmup: int = 2, restart_each_epoch: bool = False) -> FeedCost:
    """The Trainer's feed of ``cfg`` at one replica over the prepared corpus ``data``, timed for ``steps`` steps
    after ``warmup`` (the loader workers' start); see the module docstring."""
    data_cfg = dataclasses.replace(cfg.data, path=str(data))
    if restart_each_epoch:
        data_cfg = dataclasses.replace(data_cfg, num_workers=0)
    plan = plan_step(cfg.train.tokens_per_step, 1, data_cfg.max_tokens, data_cfg.max_len + 1)

    def stream(index: int, count: int) -> TokenBatchStream:
        return TokenBatchStream.from_config(
            data_cfg, "train", dp_rank=index, dp_size=count, shuffle=True, repeat=not restart_each_epoch,
            max_tokens=plan.max_tokens_per_micro_batch,
        )  # fmt: skip

    source = stream(0, 1)
    batches = _batches(source, restart_each_epoch)
    try:
        for _ in range(warmup * plan.micro_batches_per_stream):
            next(batches)
        first_epoch, tokens, cpu = source.epoch, 0.0, []
        wall = time.perf_counter()
        for _ in range(steps):
            began = time.process_time()
            tokens += sum(next(batches).tgt_tokens for _ in range(plan.micro_batches_per_stream))
            cpu.append(time.process_time() - began)
        wall = (time.perf_counter() - wall) / steps
        epochs = source.epoch - first_epoch
        return FeedCost(sum(cpu) / steps, statistics.median(cpu), wall, steps, epochs, tokens / steps)
    finally:
        batches.close()


def _batches(source: TokenBatchStream, restart_each_epoch: bool) -> Iterator[Batch]:
    """The stream's batches; with ``restart_each_epoch`` (``repeat=False``) a new loader for every epoch."""
    while True:
        it = iter(source)
        try:
            yield from it
        finally:
            it.close()  # its loader workers stop now
        if not restart_each_epoch:
            return


def feed_op(seconds: float) -> Op:
    """The feed as the first operator of a recorded step: host work only, no kernel (see the module docstring)."""
    return Op("feed (the data feed, measured on this CPU)", 0.0, 0.0, 0, False, False, False, "", "feed", seconds)
