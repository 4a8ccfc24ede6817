"""Layout arithmetic, checked before any process group exists.

A pure dataclass: it knows the world size, the tensor-parallel size and the model's
shape, and rejects a layout that cannot be split with a message that says what to
change. ``megaformer info``, the launcher and the tests use it without processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megaformer.config import ModelConfig, ParallelConfig
from megaformer.errors import ConfigError


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Round the vocabulary up to a multiple of lcm(multiple, tp * 8).

    With the default multiple of 128 the padded size is the same for every TP size up
    to 16, so checkpoints keep one embedding shape across layouts. Padded rows never
    get probability (the loss and the decoder mask them).
    """
    step = math.lcm(multiple, tp * 8)
    return -(-vocab_size // step) * step


@dataclass(frozen=True)
class ParallelLayout:
    """World = DP x TP with TP ranks contiguous: rank r has tp_rank r % tp and dp_rank r // tp."""

    world_size: int
    tp: int
    dp: int

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelLayout:
        if cfg.tp < 1:
            raise ConfigError(f"parallel.tp must be at least 1, got {cfg.tp}")
        if world_size % cfg.tp:
            raise ConfigError(
                f"parallel.tp={cfg.tp} does not divide the world size {world_size}: "
                f"launch a multiple of {cfg.tp} processes or choose a tp that divides {world_size}"
            )
        dp = cfg.dp or world_size // cfg.tp
        if cfg.tp * dp != world_size:
            raise ConfigError(
                f"parallel.tp x parallel.dp = {cfg.tp} x {dp} = {cfg.tp * dp} but the world size is {world_size}: "
                f"set parallel.dp={world_size // cfg.tp} (or 0 to derive it)"
            )
        return cls(world_size=world_size, tp=cfg.tp, dp=dp)

    def tp_groups(self) -> list[list[int]]:
        """Ranks of each tensor-parallel group: contiguous, so TP stays inside a node."""
        return [list(range(d * self.tp, (d + 1) * self.tp)) for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        """Ranks of each data-parallel group: the ranks that hold the same model shard."""
        return [list(range(t, self.world_size, self.tp)) for t in range(self.tp)]


def check_model_split(model: ModelConfig, tp: int) -> None:
    """Reject a model shape that cannot be split over ``tp`` ranks, saying what to change."""
    if model.d_model % model.num_heads:
        raise ConfigError(
            f"model.d_model={model.d_model} is not divisible by model.num_heads={model.num_heads}: "
            f"choose num_heads among {_divisors(model.d_model)[:12]}"
        )
    if model.num_heads % tp:
        raise ConfigError(
            f"model.num_heads={model.num_heads} is not divisible by parallel.tp={tp}: "
            f"each rank must own whole heads; use parallel.tp in {_divisors(model.num_heads)} "
            f"or num_heads a multiple of {tp}"
        )
    if model.d_ff % tp:
        raise ConfigError(
            f"model.d_ff={model.d_ff} is not divisible by parallel.tp={tp}: "
            f"use parallel.tp in {_divisors(model.d_ff)[:12]} or d_ff a multiple of {tp}"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
