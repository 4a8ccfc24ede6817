"""What a rank's step holds and sends, recorded from the real code: live tensor bytes and collectives.

Two ``TorchDispatchMode`` recorders, used alike on tensors that hold no data (the plan's traces, on
the ``meta`` device or under ``FakeTensorMode`` with a fake process group) and on a real CPU run
over gloo (``benchmarks/plan_check.py``, which checks the plan against what runs):

* :class:`LiveBytes` counts the bytes of every tensor storage an operator makes, from its first
  operator until the storage is freed (a weak reference to the storage), and keeps the peak.
  This is "memory" in the plan: the bytes of live tensor storage, without an allocator's rounding,
  caching or fragmentation, Python objects, or a collective library's own buffers.
* :class:`CollectiveRecorder` writes one :class:`Collective` for every ``c10d`` operator
  (all-reduce, all-gather, reduce-scatter, broadcast, send, receive): its operator, the group by
  name (``ranks`` maps each of the context's groups to one) and its payload bytes, the tensors
  the caller hands in (a reduce-scatter's whole input, an all-gather's own shard).
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megaformer.sim.ops import _tensors

# c10d operator -> the collective it is (coalesced and single-tensor forms alike)
COLLECTIVES = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "broadcast_": "broadcast",
    "send": "send",
    "recv_": "recv",
    "barrier": "barrier",
}


@dataclass(frozen=True)
class Collective:
    """One collective call: ``op`` over ``group`` (a name), ``bytes`` of payload."""

    op: str
    group: str
    bytes: int


def _payload(op: str, args: tuple) -> int:
    """The bytes a caller hands to ``op``: the first argument's tensors, except a gather's or scatter's."""
    if op == "all_gather":  # (outputs, inputs, ...) or (output, input, ...): the input, one rank's shard
        tensors = _tensors(args[1])
    elif op == "reduce_scatter":  # (outputs, inputs, ...): the whole input
        tensors = _tensors(args[1])
    else:
        tensors = _tensors(args[0])
    return sum(t.numel() * t.element_size() for t in tensors)


def _group_of(args: tuple) -> dist.ProcessGroup | None:
    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(arg)
            except (RuntimeError, TypeError):
                return None
    return None


class CollectiveRecorder(TorchDispatchMode):
    """Records every collective dispatched inside it (see the module docstring).

    ``groups``: name -> process group, the context's (tp, dp, pp, model, world); a group not among
    them is named by its size (``size-N``)."""

    def __init__(self, groups: dict[str, dist.ProcessGroup | None]) -> None:
        super().__init__()
        self.names = {id(g): name for name, g in groups.items() if g is not None}
        self.calls: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            op = COLLECTIVES.get(func._overloadpacket.__name__)
            if op is not None and op != "barrier":
                group = _group_of(args)
                name = self.names.get(id(group)) if group is not None else None
                if name is None and group is not None:
                    name = f"size-{group.size()}"
                self.calls.append(Collective(op, name or "?", _payload(op, args)))
        return func(*args, **kwargs)

    def summary(self) -> dict[str, dict[str, int]]:
        """``"op group" -> {"count", "bytes"}``, sorted."""
        return summarize(self.calls)


def summarize(calls: list[Collective]) -> dict[str, dict[str, int]]:
    """``"op group" -> {"count", "bytes"}`` of ``calls``, sorted by key."""
    counts, sizes = Counter(), Counter()
    for c in calls:
        key = f"{c.op} {c.group}"
        counts[key] += 1
        sizes[key] += c.bytes
    return {key: {"count": counts[key], "bytes": sizes[key]} for key in sorted(counts)}


class LiveBytes(TorchDispatchMode):
    """The bytes of live tensor storage made inside it, now and at the peak (see the module docstring).

    :meth:`see` counts tensors made before it was entered (a model's parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[int, weakref.ref]] = {}
        self.now = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            self.see(t)
        return out

    def see(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self.live:
                continue
            nbytes = storage.nbytes()
            self.live[key] = (nbytes, weakref.ref(storage, lambda _, key=key: self._free(key)))
            self.now += nbytes
            self.peak = max(self.peak, self.now)

    def _free(self, key: int) -> None:
        nbytes, _ = self.live.pop(key, (0, None))
        self.now -= nbytes

    def reset_peak(self) -> None:
        self.peak = self.now
