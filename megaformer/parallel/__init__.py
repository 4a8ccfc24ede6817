"""The Megatron-style tensor-parallel core: the only package that knows process groups."""

from megaformer.parallel.comm import (
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
    scatter_to_tp,
)
from megaformer.parallel.groups import LOCAL, ParallelContext, TPGroup
from megaformer.parallel.layers import ColumnParallelLinear, LayerNorm, RowParallelLinear, VocabParallelEmbedding
from megaformer.parallel.layout import ParallelLayout, check_model_split, padded_vocab_size
from megaformer.parallel.loss import vocab_parallel_cross_entropy
from megaformer.parallel.rng import Dropout, DropoutRNG
from megaformer.parallel.sharding import (
    gather_full,
    gather_full_state,
    init_parameters,
    load_full_state,
    mark_sharded,
    shard_full,
    tp_dim,
    tp_partitions,
)

__all__ = [
    "LOCAL",
    "ColumnParallelLinear",
    "Dropout",
    "DropoutRNG",
    "LayerNorm",
    "ParallelContext",
    "ParallelLayout",
    "RowParallelLinear",
    "TPGroup",
    "VocabParallelEmbedding",
    "check_model_split",
    "copy_to_tp",
    "gather_from_sequence",
    "gather_from_tp",
    "gather_full",
    "gather_full_state",
    "init_parameters",
    "load_full_state",
    "mark_sharded",
    "padded_vocab_size",
    "reduce_from_tp",
    "reduce_scatter_to_sequence",
    "scatter_to_sequence",
    "scatter_to_tp",
    "shard_full",
    "tp_dim",
    "tp_partitions",
    "vocab_parallel_cross_entropy",
]
