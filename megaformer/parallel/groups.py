"""The parallel context: built once at start-up, then passed explicitly.

This is the only module that creates process groups. Nothing here is global: a
:class:`ParallelContext` holds the TP and DP groups of this rank, and layers receive
the :class:`TPGroup` they work in as a required argument. A TP=1 reference model in
the same process simply receives :data:`LOCAL` (a group of one, every collective a
no-op).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megaformer.config import ParallelConfig
from megaformer.parallel.layout import ParallelLayout


@dataclass(frozen=True)
class TPGroup:
    """The tensor-parallel group a layer works in: ``size`` ranks, this one being ``rank``."""

    group: dist.ProcessGroup | None
    size: int
    rank: int


LOCAL = TPGroup(group=None, size=1, rank=0)


@dataclass(frozen=True)
class ParallelContext:
    """This rank's place in the DP x TP grid and the groups it belongs to."""

    layout: ParallelLayout
    rank: int
    local_rank: int
    tp: TPGroup
    dp_group: dist.ProcessGroup | None
    device: torch.device
    backend: str

    @property
    def dp_rank(self) -> int:
        return self.rank // self.layout.tp

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def world_group(self) -> dist.ProcessGroup | None:
        """Every rank of the run (control collectives: token counts, stop flags, checkpoint barriers)."""
        return dist.group.WORLD if self.layout.world_size > 1 or dist.is_initialized() else None

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> ParallelContext:
        """A one-process context that needs no ``torch.distributed``."""
        return cls(ParallelLayout(1, 1, 1), 0, 0, LOCAL, None, torch.device(device), "none")

    @classmethod
    def initialize(
        cls,
        cfg: ParallelConfig,
        rank: int,
        world_size: int,
        local_rank: int = 0,
        init_method: str | None = None,
        timeout_s: float = 600.0,
        single_process_group: bool = False,
    ) -> ParallelContext:
        """Validate the layout, start ``torch.distributed`` if needed, and build the groups.

        ``init_method`` defaults to ``env://`` (MASTER_ADDR / MASTER_PORT), which every
        launcher in ``launcher/`` sets. The layout is validated before any group exists.
        One process gets no process group unless ``single_process_group`` (DeepSpeed
        needs one even then).
        """
        layout = ParallelLayout.from_config(cfg, world_size)
        backend = cfg.backend if cfg.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
        device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(device)
        if world_size == 1 and not dist.is_initialized() and not single_process_group:
            return cls(layout, 0, 0, LOCAL, None, device, backend)
        if not dist.is_initialized():
            dist.init_process_group(
                backend,
                init_method=init_method or "env://",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        # new_group must be called by every rank for every group, in the same order.
        tp_group = dp_group = None
        for ranks in layout.tp_groups():
            group = dist.new_group(ranks)
            if rank in ranks:
                tp_group = group
        for ranks in layout.dp_groups():
            group = dist.new_group(ranks)
            if rank in ranks:
                dp_group = group
        tp = TPGroup(group=tp_group, size=layout.tp, rank=rank % layout.tp) if layout.tp > 1 else LOCAL
        return cls(layout, rank, local_rank, tp, dp_group, device, backend)

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def env_rank() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from the variables torchrun and our launcher set."""
    return (
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("LOCAL_RANK", "0")),
        int(os.environ.get("WORLD_SIZE", "1")),
    )
