"""How many micro-batches of how many tokens make one optimizer step, at any world size.

An optimizer step reads ``micro_batches_per_stream`` micro-batches of at most
``max_tokens_per_micro_batch`` tokens (per side, padding counted) from each of the run's
``streams`` data streams (one per DP rank when the run started, see
:mod:`megaformer.train.feed`), so the step holds at most

    tokens_per_step = streams x micro_batches_per_stream x max_tokens_per_micro_batch

tokens. ``train.tokens_per_step`` is the optimisation's batch size (the paper's 25,000
tokens): it must not change with the number of GPUs. Rounding the micro-batch count to
at least one made a step 4-5x larger once ``streams x data.max_tokens`` exceeded it (32
DP ranks x 4096 tokens = 131,072 for a 25,000-token config). :func:`plan_step` keeps the
step within ``tolerance`` (10 %) of the config by *lowering* the micro-batch (never
raising it: ``data.max_tokens`` is the memory bound), or refuses with what to change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megaformer.errors import ConfigError

TOLERANCE = 0.10


@dataclass(frozen=True)
class StepPlan:
    """One optimizer step: ``micro_batches_per_stream`` micro-batches from each of ``streams`` streams."""

    streams: int
    micro_batches_per_stream: int
    max_tokens_per_micro_batch: int

    @property
    def tokens_per_step(self) -> int:
        """The most tokens (per side, padding counted) one optimizer step can hold."""
        return self.streams * self.micro_batches_per_stream * self.max_tokens_per_micro_batch

    def micro_batches_per_rank(self, dp: int) -> int:
        """Micro-batches one DP rank runs per step (it reads ``streams / dp`` streams)."""
        return self.micro_batches_per_stream * self.streams // dp


def plan_step(
    tokens_per_step: int,
    streams: int,
    max_tokens: int,
    min_tokens: int = 1,
    tolerance: float = TOLERANCE,
) -> StepPlan:
    """The micro-batches of one step: within ``tolerance`` of ``tokens_per_step`` at any ``streams``.

    ``max_tokens`` (``data.max_tokens``) is kept when ``round(target / max_tokens)``
    micro-batches per stream already land within the tolerance (so existing runs keep
    their batches); otherwise each stream takes ``k = ceil(target / max_tokens)``
    micro-batches of ``floor(target / k)`` tokens, where ``target = tokens_per_step /
    streams``. The micro-batch must still hold the longest sample, ``min_tokens``
    (``data.max_len + 1`` with eos); when it cannot, the step would grow, and this
    raises :class:`ConfigError` saying what to change.
    """
    if tokens_per_step < 1 or streams < 1 or max_tokens < 1:
        raise ConfigError(
            f"train.tokens_per_step={tokens_per_step}, data streams={streams} and data.max_tokens={max_tokens} "
            "must all be at least 1"
        )
    target = tokens_per_step / streams
    kept = StepPlan(streams, max(1, round(target / max_tokens)), max_tokens)
    if _within(kept, tokens_per_step, tolerance):
        return kept
    per_stream = math.ceil(target / max_tokens)
    plan = StepPlan(streams, per_stream, int(target // per_stream))
    if plan.max_tokens_per_micro_batch < min_tokens or not _within(plan, tokens_per_step, tolerance):
        need = streams * min_tokens
        raise ConfigError(
            f"train.tokens_per_step={tokens_per_step} over {streams} data stream{'s' * (streams != 1)} (one per "
            f"DP rank at the run's start) leaves "
            f"{target:.0f} tokens per stream, less than one micro-batch holding the longest sample "
            f"({min_tokens} tokens, data.max_len + 1): raise train.tokens_per_step to at least {need}, "
            f"use fewer DP ranks (a larger parallel.tp), or lower data.max_len"
        )
    return plan


def _within(plan: StepPlan, tokens_per_step: int, tolerance: float) -> bool:
    return abs(plan.tokens_per_step - tokens_per_step) <= tolerance * tokens_per_step


def stream_count(saved_streams: int | None, dp: int) -> int:
    """Streams of a run: kept from its checkpoint when the DP size divides them, else the DP size."""
    if saved_streams and saved_streams % dp == 0:
        return saved_streams
    return dp
