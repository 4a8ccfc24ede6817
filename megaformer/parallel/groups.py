"""The parallel context: built once at start-up, then passed explicitly.

This is the only module that creates process groups. Nothing here is global: a
:class:`ParallelContext` holds the TP and DP groups of this rank, and layers receive
the :class:`TPGroup` they work in as a required argument. A TP=1 reference model in
the same process simply receives :data:`LOCAL` (a group of one, every collective a
no-op).
"""

from __future__ import annotations

import datetime
import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megaformer.config import ParallelConfig
from megaformer.errors import ConfigError
from megaformer.parallel.layout import ParallelLayout, check_tp_within_nodes

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPGroup:
    """The tensor-parallel group a layer works in: ``size`` ranks, this one being ``rank``."""

    group: dist.ProcessGroup | None
    size: int
    rank: int


LOCAL = TPGroup(group=None, size=1, rank=0)


def describe_nodes(hosts: Sequence[str]) -> str:
    """``n1: ranks 0,1; n2: ranks 2,3`` -- which ranks each node holds, in rank order."""
    nodes: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        nodes.setdefault(host, []).append(rank)
    return "; ".join(f"{host}: ranks {','.join(map(str, ranks))}" for host, ranks in nodes.items())


def pick_device(backend: str, local_rank: int, kind: str = "auto") -> torch.device:
    """The rank's device, from ``parallel.device`` (``kind``) and the backend.

    ``auto``: a GPU with nccl, the CPU with gloo. ``cuda``: a GPU with either backend
    (gloo then carries CUDA tensors through host memory, which lets several ranks share
    one GPU for testing). ``cpu``: the CPU (gloo only). A GPU is ``cuda:0`` when the task
    sees exactly one (SLURM ``--gpus-per-task``, ``--gpu-bind``, CUDA_VISIBLE_DEVICES
    naming one device), else ``cuda:<local_rank mod visible GPUs>``; with nccl every
    local rank needs a GPU of its own.
    """
    if kind == "cpu" or (kind == "auto" and backend != "nccl"):
        if backend == "nccl":
            raise ConfigError("parallel.backend=nccl reduces GPU tensors only: set parallel.device=cuda or auto")
        return torch.device("cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError(f"parallel.device={kind} with backend {backend}: no GPU is visible to this process")
    if backend == "nccl" and count > 1 and local_rank >= count:
        raise ConfigError(
            f"local rank {local_rank} but only {count} GPUs visible: nccl needs one GPU per rank "
            f"(start at most {count} ranks per node, or use parallel.backend=gloo to share GPUs)"
        )
    return torch.device("cuda", local_rank % count)


def _create_groups(
    layout: ParallelLayout, rank: int
) -> tuple[list[dist.ProcessGroup], dict[str, dist.ProcessGroup | None]]:
    """Every TP, DP (and with pp > 1, pipeline and model) group, and this rank's of each kind.

    ``new_group`` must be called by every rank for every group, in the same order.
    """
    created: list[dist.ProcessGroup] = []
    mine: dict[str, dist.ProcessGroup | None] = {"tp": None, "dp": None, "pp": None, "model": None}
    kinds = [("tp", layout.tp_groups()), ("dp", layout.dp_groups())]
    if layout.pp > 1:
        kinds += [("pp", layout.pp_groups()), ("model", layout.model_groups())]
    for kind, all_ranks in kinds:
        for ranks in all_ranks:
            created.append(dist.new_group(ranks))
            if rank in ranks:
                mine[kind] = created[-1]
    return created, mine


@dataclass(frozen=True)
class ParallelContext:
    """This rank's place in the DP x TP grid and the groups it belongs to.

    ``hosts`` holds every rank's host name (gathered once at start-up); ``owns_world`` says
    whether :meth:`initialize` started ``torch.distributed`` (and so may end it), and
    ``groups`` the sub-groups it created.
    """

    layout: ParallelLayout
    rank: int
    local_rank: int
    tp: TPGroup
    dp_group: dist.ProcessGroup | None
    device: torch.device
    backend: str
    hosts: tuple[str, ...] = ()
    owns_world: bool = False
    groups: tuple[dist.ProcessGroup, ...] = ()
    pp_group: dist.ProcessGroup | None = None  # this rank's pipeline: the stages of its (DP, TP) place
    model_group: dist.ProcessGroup | None = None  # TP x PP: the ranks holding one model replica

    @property
    def dp_rank(self) -> int:
        return self.layout.coordinates(self.rank)[1]

    @property
    def pp_rank(self) -> int:
        return self.layout.coordinates(self.rank)[0]

    @property
    def pp_size(self) -> int:
        return self.layout.pp

    def stage_rank(self, pp_rank: int) -> int:
        """The global rank of stage ``pp_rank`` of this rank's pipeline."""
        _, dp_rank, tp_rank = self.layout.coordinates(self.rank)
        return self.layout.rank_of(pp_rank, dp_rank, tp_rank)

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
        timeout_s: float | None = None,
        single_process_group: bool = False,
    ) -> ParallelContext:
        """Validate the layout, start ``torch.distributed`` if needed, and build the groups.

        ``init_method`` defaults to ``env://`` (MASTER_ADDR / MASTER_PORT), which every
        launcher in ``launcher/`` sets. The layout is validated before any group exists.
        One process gets no process group unless ``single_process_group`` (DeepSpeed
        needs one even then; meeting no one, it takes an in-process store, not a port). A
        collective that waits longer than ``timeout_s`` (default ``parallel.timeout_minutes``)
        fails instead of hanging. The ranks' host names are gathered once, and a TP group
        spanning nodes is refused (:func:`check_tp_within_nodes`).
        """
        layout = ParallelLayout.from_config(cfg, world_size)
        backend = cfg.backend if cfg.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
        device = pick_device(backend, local_rank, cfg.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if world_size == 1 and not dist.is_initialized() and not single_process_group:
            return cls(layout, 0, 0, LOCAL, None, device, backend, (socket.gethostname(),))
        owns_world = not dist.is_initialized()
        if owns_world:
            timeout = datetime.timedelta(seconds=timeout_s if timeout_s is not None else 60 * cfg.timeout_minutes)
            _start_world(backend, init_method, rank, world_size, timeout)
        hosts: list[str | None] = [None] * world_size
        dist.all_gather_object(hosts, socket.gethostname())
        check_tp_within_nodes(layout, hosts)
        if rank == 0 and len(set(hosts)) > 1:
            stages = f" pp={layout.pp}" if layout.pp > 1 else ""
            LOG.info(f"parallel: tp={layout.tp} dp={layout.dp}{stages}; {describe_nodes(hosts)}")
        created, mine = _create_groups(layout, rank)
        tp = TPGroup(group=mine["tp"], size=layout.tp, rank=rank % layout.tp) if layout.tp > 1 else LOCAL
        return cls(
            layout,
            rank,
            local_rank,
            tp,
            mine["dp"],
            device,
            backend,
            tuple(hosts),
            owns_world,
            tuple(created),
            pp_group=mine["pp"],
            model_group=mine["model"] if layout.pp > 1 else tp.group,
        )

    def destroy(self) -> None:
        """End what :meth:`initialize` created: the whole of ``torch.distributed`` if it started
        it, else only its own sub-groups (a caller's default group stays usable)."""
        if not dist.is_initialized():
            return
        if self.owns_world:
            dist.destroy_process_group()
            return
        for group in self.groups:
            if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(group)


def _start_world(
    backend: str, init_method: str | None, rank: int, world_size: int, timeout: datetime.timedelta
) -> None:
    """``torch.distributed``'s default group; ranks that never meet raise a one-line ConfigError."""
    try:
        if world_size == 1 and init_method is None:
            # A world of one meets no one: an in-process store, not a TCP port, which another
            # process could take between the port's choice and the store's bind (EADDRINUSE).
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(
                backend, init_method=init_method or "env://", rank=rank, world_size=world_size, timeout=timeout
            )
    except (dist.DistStoreError, dist.DistNetworkError) as err:
        raise ConfigError(_no_rendezvous(rank, world_size, init_method, err)) from None


def _no_rendezvous(rank: int, world_size: int, init_method: str | None, err: Exception) -> str:
    """One line for ranks that never met: who waited where, and what to check."""
    where = init_method or "env:// (MASTER_ADDR, MASTER_PORT)"
    reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return (
        f"rank {rank} of {world_size}: the ranks did not all meet at {where} ({reason}): start every rank "
        f"(torchrun, srun or --nproc), check MASTER_ADDR/MASTER_PORT, or raise parallel.timeout_minutes"
    )
