"""The Megatron-style tensor-parallel core: the only package that knows process groups.

The names below are imported on first use (PEP 562): ``megaformer train`` checks a layout
(:mod:`megaformer.parallel.layout`, which needs no torch) in a launching process that only
starts the ranks and never imports torch itself (~1.5 CPU seconds a launch).
"""

from __future__ import annotations

from megaformer.lazy import lazy_names

_EXPORTS = {
    ".comm": (
        "copy_to_tp",
        "gather_from_sequence",
        "gather_from_tp",
        "reduce_from_tp",
        "reduce_scatter_to_sequence",
        "scatter_to_sequence",
        "scatter_to_tp",
    ),
    ".groups": ("LOCAL", "ParallelContext", "TPGroup"),
    ".layers": ("ColumnParallelLinear", "LayerNorm", "RowParallelLinear", "VocabParallelEmbedding"),
    ".layout": ("ParallelLayout", "check_model_split", "check_tp_within_nodes", "padded_vocab_size"),
    ".loss": ("vocab_parallel_cross_entropy",),
    ".rng": ("Dropout", "DropoutRNG"),
    ".sharding": (
        "gather_full",
        "gather_full_state",
        "init_parameters",
        "load_full_state",
        "mark_sharded",
        "shard_full",
        "tp_dim",
        "tp_partitions",
    ),
}
_MODULE_OF, __getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
__all__ = sorted(_MODULE_OF)
