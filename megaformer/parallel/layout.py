"""Layout arithmetic, checked before any process group exists.

A pure dataclass: it knows the world size, the tensor-parallel size and the model's
shape, and rejects a layout that cannot be split with a message that says what to
change. ``megaformer info``, the launcher and the tests use it without processes.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
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
    """World = PP x DP x TP, TP innermost: rank r has tp_rank r % tp, dp_rank (r // tp) % dp, pp_rank r // (tp dp).

    TP ranks are contiguous (inside a node), then DP, then pipeline stages, so that the
    stages of a large job sit on different nodes and only point-to-point activations
    cross between them.
    """

    world_size: int
    tp: int
    dp: int
    pp: int = 1

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelLayout:
        if cfg.tp < 1:
            raise ConfigError(f"parallel.tp must be at least 1, got {cfg.tp}")
        if cfg.pp < 1:
            raise ConfigError(f"parallel.pp must be at least 1, got {cfg.pp}")
        model_ranks = cfg.tp * cfg.pp
        model = (
            f"parallel.tp x parallel.pp = {cfg.tp} x {cfg.pp} = {model_ranks}"
            if cfg.pp > 1
            else f"parallel.tp={cfg.tp}"
        )
        if world_size % model_ranks:
            raise ConfigError(
                f"{model} does not divide the world size {world_size}: launch a multiple of {model_ranks} "
                f"processes (e.g. train --nproc {model_ranks} on one machine) or choose a layout whose model ranks "
                f"divide {world_size}"
            )
        dp = cfg.dp or world_size // model_ranks
        if model_ranks * dp != world_size:
            names, sizes = (
                ("tp x parallel.dp x parallel.pp", f"{cfg.tp} x {dp} x {cfg.pp}")
                if cfg.pp > 1
                else ("tp x parallel.dp", f"{cfg.tp} x {dp}")
            )
            raise ConfigError(
                f"parallel.{names} = {sizes} = {model_ranks * dp} but the world size is {world_size}: "
                f"set parallel.dp={world_size // model_ranks} (or 0 to derive it)"
            )
        return cls(world_size=world_size, tp=cfg.tp, dp=dp, pp=cfg.pp)

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of ``rank``."""
        return rank // (self.tp * self.dp), (rank // self.tp) % self.dp, rank % self.tp

    def tp_groups(self) -> list[list[int]]:
        """Ranks of each tensor-parallel group: contiguous, so TP stays inside a node."""
        return [[self.rank_of(p, d, t) for t in range(self.tp)] for p in range(self.pp) for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        """Ranks of each data-parallel group: the ranks that hold the same model shard (same stage, same TP rank)."""
        return [[self.rank_of(p, d, t) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)]

    def pp_groups(self) -> list[list[int]]:
        """Ranks of each pipeline: one per (DP, TP) place, its stages in order."""
        return [[self.rank_of(p, d, t) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)]

    def model_groups(self) -> list[list[int]]:
        """Ranks that together hold one model replica (TP x PP, one DP place): gradient norms and overflow."""
        return [[self.rank_of(p, d, t) for p in range(self.pp) for t in range(self.tp)] for d in range(self.dp)]


def check_model_split(model: ModelConfig, tp: int, option: str = "parallel.tp") -> None:
    """Reject a model shape that cannot be split over ``tp`` ranks, saying what to change (``option``: what set tp)."""
    if model.d_model % model.num_heads:
        raise ConfigError(
            f"model.d_model={model.d_model} is not divisible by model.num_heads={model.num_heads}: "
            f"choose num_heads among {_divisors(model.d_model)[:12]}"
        )
    if model.num_heads % tp:
        raise ConfigError(
            f"model.num_heads={model.num_heads} is not divisible by {option}={tp}: "
            f"each rank must own whole heads; use {option} in {_divisors(model.num_heads)} "
            f"or num_heads a multiple of {tp}"
        )
    if model.d_ff % tp:
        raise ConfigError(
            f"model.d_ff={model.d_ff} is not divisible by {option}={tp}: "
            f"use {option} in {_divisors(model.d_ff)[:12]} or d_ff a multiple of {tp}"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_tp_within_nodes(layout: ParallelLayout, hosts: Sequence[str]) -> None:
    """Every TP group must lie inside one node: TP all-reduces once per sublayer, which only a
    node's own links (NVLink, shared memory) carry fast enough. ``hosts[r]`` is rank r's host.

    The error names the groups that span nodes and the TP sizes that would not: the divisors
    of the smallest number of ranks a node holds (ranks are numbered node by node).
    """
    split = [ranks for ranks in layout.tp_groups() if len({hosts[r] for r in ranks}) > 1]
    if not split:
        return
    per_node = min(Counter(hosts).values())
    fits = [t for t in range(1, per_node + 1) if per_node % t == 0 and layout.world_size % t == 0]
    where = "; ".join(f"ranks {ranks} on {', '.join(sorted({hosts[r] for r in ranks}))}" for ranks in split[:3])
    raise ConfigError(
        f"parallel.tp={layout.tp} puts tensor-parallel groups across nodes ({where}): "
        f"with {per_node} rank(s) per node use parallel.tp in {fits}, or launch more ranks per node"
    )


def lean_refusal(precision: str, dp: int, pp: int) -> str | None:
    """Why the lean engine (``train.optimizer=lean``) cannot train a run of this precision and layout (None: it
    can): it holds one whole replica, in fp32 or bf16. Torch-free, so that ``train --check`` asks it too."""
    if dp == 1 and pp == 1 and precision in ("fp32", "bf16"):
        return None
    return (
        f"train.optimizer=lean runs one replica without a pipeline in fp32 or bf16, not dp={dp} "
        f"pp={pp} {precision}: set train.optimizer=auto (DeepSpeed here) or deepspeed"
    )
