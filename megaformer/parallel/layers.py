"""Megatron-style parallel layers: column- and row-parallel linear, vocab-parallel embedding.

Every layer takes its :class:`TPGroup` as a required argument and only composes the
conjugate collectives of :mod:`megaformer.parallel.comm`. With ``sequence_parallel``
the activations outside the TP regions are split along the sequence: column-parallel
layers all-gather their input, row-parallel layers reduce-scatter their output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megaformer.parallel.comm import (
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence,
)
from megaformer.parallel.cpu_matmul import linear
from megaformer.parallel.groups import TPGroup
from megaformer.parallel.sharding import mark_sharded


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {d}")
    return n // d


class ColumnParallelLinear(nn.Module):
    """Y = XA + b with A = [A_1 .. A_p] split by columns: rank i computes Y_i = X A_i + b_i.

    The input is replicated (backward all-reduces its gradient) or, with sequence
    parallelism, all-gathered along the sequence. ``partitions`` > 1 declares a fused
    weight of that many stacked blocks (Q, K, V) split block by block, so each rank
    owns whole heads of every block. The output stays split unless ``gather_output``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TPGroup,
        bias: bool = True,
        partitions: int = 1,
        gather_output: bool = False,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        if gather_output and partitions > 1:
            raise ValueError(
                "gather_output with stacked blocks would interleave them by rank: gather each block instead"
            )
        self.tp = tp
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel and tp.size > 1
        local_out = _divide(out_features, tp.size, "out_features")
        _divide(out_features // partitions, tp.size, "out_features per block")
        self.weight = nn.Parameter(torch.empty(local_out, in_features))
        mark_sharded(self.weight, dim=0, partitions=partitions, init="xavier")
        if bias:
            self.bias = nn.Parameter(torch.empty(local_out))
            mark_sharded(self.bias, dim=0, partitions=partitions, init="zeros")
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_from_sequence(x, self.tp) if self.sequence_parallel else copy_to_tp(x, self.tp)
        y = linear(x, self.weight, self.bias)  # (..., out_features / tp)
        return gather_from_tp(y, self.tp) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in={self.weight.shape[1]}, out_per_rank={self.weight.shape[0]}, tp={self.tp.size}"


class RowParallelLinear(nn.Module):
    """Y = XA + b with A = [A_1; ..; A_p] split by rows and X = [X_1 .. X_p] split by columns.

    Rank i computes X_i A_i; the partial products are summed with one all-reduce (or
    reduce-scattered along the sequence with sequence parallelism); the replicated
    bias is added after the sum.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TPGroup,
        bias: bool = True,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.weight = nn.Parameter(torch.empty(out_features, _divide(in_features, tp.size, "in_features")))
        mark_sharded(self.weight, dim=1, init="xavier")
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
            mark_sharded(self.bias, dim=None, init="zeros")
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:  # nothing to sum: the bias rides in the matmul (addmm), one pass fewer
            return linear(x, self.weight, self.bias)
        y = linear(x, self.weight)  # (..., out_features), a partial sum
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(y, self.tp)
            # Each rank adds the bias to its part of the sequence: sum its gradient over ranks.
            return y + copy_to_tp(self.bias, self.tp) if self.bias is not None else y
        y = reduce_from_tp(y, self.tp)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in_per_rank={self.weight.shape[1]}, out={self.weight.shape[0]}, tp={self.tp.size}"


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary rows: rank i holds rows [i V/p, (i+1) V/p).

    Each rank looks up the ids in its range (zeros elsewhere) and one all-reduce sums
    the ranks (a reduce-scatter along the sequence with sequence parallelism). The
    same table is the output projection (:meth:`logits`), paper section 3.4.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp: TPGroup,
        padding_idx: int | None = None,
        sequence_parallel: bool = False,
        real_num_embeddings: int | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.num_embeddings = num_embeddings
        self.real_num_embeddings = real_num_embeddings or num_embeddings  # rows past it only pad the table
        self.padding_idx = padding_idx
        local = _divide(num_embeddings, tp.size, "padded vocabulary size")
        self.vocab_start = tp.rank * local
        self.vocab_end = self.vocab_start + local
        self.weight = nn.Parameter(torch.empty(local, embedding_dim))
        mark_sharded(self.weight, dim=0, init=f"normal:{embedding_dim**-0.5}")

    def post_init(self) -> None:
        """Zero the padding id's row and the rows that only pad the table to a multiple of tp x 8."""
        with torch.no_grad():
            if self.padding_idx is not None and self.vocab_start <= self.padding_idx < self.vocab_end:
                self.weight[self.padding_idx - self.vocab_start].zero_()
            first_pad = max(self.real_num_embeddings - self.vocab_start, 0)
            self.weight[first_pad:].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.tp)
        return reduce_from_tp(out, self.tp)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the output logits, x E_i^T: (..., V / tp). Never gathered here."""
        x = gather_from_sequence(x, self.tp) if self.sequence_parallel else copy_to_tp(x, self.tp)
        return linear(x, self.weight)


class LayerNorm(nn.Module):
    """LayerNorm with replicated parameters.

    Under sequence parallelism each rank normalises only its part of the sequence, so
    the parameters' gradients are partial: they enter through :func:`copy_to_tp`, whose
    backward sums them over the TP group.
    """

    def __init__(self, dim: int, tp: TPGroup, eps: float = 1e-5, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.eps = eps
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim))
        mark_sharded(self.weight, dim=None, init="ones")
        mark_sharded(self.bias, dim=None, init="zeros")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if self.sequence_parallel:
            weight, bias = copy_to_tp(weight, self.tp), copy_to_tp(bias, self.tp)
        return F.layer_norm(x, x.shape[-1:], weight, bias, self.eps)
