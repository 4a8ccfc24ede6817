"""The Megatron-style tensor-parallel core: the only package that knows process groups.

The names below are imported on first use (PEP 562): ``megaformer train`` checks a layout
(:mod:`megaformer.parallel.layout`, which needs no torch) in a launching process that only
starts the ranks and never imports torch itself (~1.5 CPU seconds a launch).
"""

from __future__ import annotations

import importlib

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
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> object:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # found once; later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
