"""Autograd-aware collectives over a tensor-parallel group, as conjugate pairs.

Each function is the forward of one collective whose backward is its conjugate:

=============================  ======================  ======================
function                       forward                 backward
=============================  ======================  ======================
``copy_to_tp``                 identity                all-reduce
``reduce_from_tp``             all-reduce              identity
``scatter_to_tp``              split last dim          all-gather last dim
``gather_from_tp``             all-gather last dim     split last dim
``scatter_to_sequence``        split sequence dim      all-gather sequence
``gather_from_sequence``       all-gather sequence     reduce-scatter sequence
``reduce_scatter_to_sequence`` reduce-scatter seq.     all-gather sequence
=============================  ======================  ======================

Every one is a no-op for a group of size 1. Layers only compose these. Activations
are batch-first, ``(batch, seq, features)``: the sequence dimension is 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megaformer.parallel.groups import TPGroup

SEQ_DIM = 1


def _all_gather_single(out: torch.Tensor, x: torch.Tensor, group) -> None:
    # torch 2.13 renamed the tensor-in/tensor-out collectives; older releases have the old names.
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x, group=group)


def _reduce_scatter_single(out: torch.Tensor, x: torch.Tensor, group) -> None:
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, x, group=group)


# ---- primitives (no autograd) ------------------------------------------------------------
# In a compiled layer (train.compile) each collective is the functional one, which returns its
# result: Dynamo in torch 2.11 traced the in-place all_reduce of a Function's backward into a graph
# that dropped its result (a compiled TP=2 run's second loss 7.459 against the eager 7.313; the
# functional form gave 7.313). Eagerly, the in-place collectives as before.


def _functional():
    from torch.distributed import _functional_collectives

    return _functional_collectives


def _all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return _functional().all_reduce(x, "sum", tp.group)
    dist.all_reduce(x, group=tp.group)
    return x


def _split(x: torch.Tensor, dim: int, tp: TPGroup) -> torch.Tensor:
    size = x.shape[dim]
    if size % tp.size:
        raise ValueError(f"cannot split dimension {dim} of size {size} over {tp.size} tensor-parallel ranks")
    return x.narrow(dim, tp.rank * (size // tp.size), size // tp.size).contiguous()


def _gather(x: torch.Tensor, dim: int, tp: TPGroup) -> torch.Tensor:
    x = x.movedim(dim, 0).contiguous()
    if torch.compiler.is_compiling():
        out = _functional().all_gather_tensor(x, 0, tp.group)
    else:
        out = x.new_empty((tp.size * x.shape[0],) + tuple(x.shape[1:]))
        _all_gather_single(out, x, group=tp.group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, tp: TPGroup) -> torch.Tensor:
    x = x.movedim(dim, 0).contiguous()
    if x.shape[0] % tp.size:
        raise ValueError(f"cannot reduce-scatter dimension {dim} of size {x.shape[0]} over {tp.size} ranks")
    if torch.compiler.is_compiling():
        out = _functional().reduce_scatter_tensor(x, "sum", 0, tp.group)
    else:
        out = x.new_empty((x.shape[0] // tp.size,) + tuple(x.shape[1:]))
        _reduce_scatter_single(out, x, group=tp.group)
    return out.movedim(0, dim).contiguous()


# ---- conjugate pairs -------------------------------------------------------------------


# autograd Functions call their context ``saved``: in this code base ``ctx`` names only the parallel context.


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(saved, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        saved.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(saved, grad: torch.Tensor):
        return _all_reduce(grad.contiguous().clone(), saved.tp), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(saved, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        return _all_reduce(x.contiguous().clone(), tp)

    @staticmethod
    def backward(saved, grad: torch.Tensor):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(saved, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        saved.tp = tp
        return _split(x, -1, tp)

    @staticmethod
    def backward(saved, grad: torch.Tensor):
        return _gather(grad, -1 % grad.dim(), saved.tp), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(saved, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        saved.tp = tp
        return _gather(x, x.dim() - 1, tp)

    @staticmethod
    def backward(saved, grad: torch.Tensor):
        return _split(grad, -1, saved.tp), None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(saved, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        saved.tp = tp
        return _split(x, SEQ_DIM, tp)

    @staticmethod
    def backward(saved, grad: torch.Tensor):
        return _gather(grad, SEQ_DIM, saved.tp), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(saved, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        saved.tp = tp
        return _gather(x, SEQ_DIM, tp)

    @staticmethod
    def backward(saved, grad: torch.Tensor):
        # The gathered tensor feeds column-parallel layers, whose input gradients are
        # partial sums over the TP group: reduce them and keep this rank's part.
        return _reduce_scatter(grad, SEQ_DIM, saved.tp), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(saved, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        saved.tp = tp
        return _reduce_scatter(x, SEQ_DIM, tp)

    @staticmethod
    def backward(saved, grad: torch.Tensor):
        return _gather(grad, SEQ_DIM, saved.tp), None


def copy_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Enter a TP region with a replicated tensor: backward sums the ranks' partial gradients."""
    return x if tp.size == 1 else _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Leave a TP region by summing the ranks' partial results."""
    return x if tp.size == 1 else _ReduceFromTP.apply(x, tp)


def scatter_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Keep this rank's slice of the last dimension."""
    return x if tp.size == 1 else _ScatterToTP.apply(x, tp)


def gather_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Concatenate the ranks' slices of the last dimension."""
    return x if tp.size == 1 else _GatherFromTP.apply(x, tp)


def scatter_to_sequence(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Keep this rank's part of the sequence (enter a sequence-parallel region)."""
    return x if tp.size == 1 else _ScatterToSequence.apply(x, tp)


def gather_from_sequence(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """All-gather the sequence before a column-parallel layer; backward reduce-scatters."""
    return x if tp.size == 1 else _GatherFromSequence.apply(x, tp)


def reduce_scatter_to_sequence(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Sum a row-parallel layer's partial outputs and keep this rank's part of the sequence."""
    return x if tp.size == 1 else _ReduceScatterToSequence.apply(x, tp)
