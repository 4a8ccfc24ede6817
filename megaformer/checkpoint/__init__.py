"""Checkpoints: collect the components' states, shard, write atomically with checksums, read back.

Below ``train/``, ``decode/`` and ``export/``, which all read checkpoints through it. Each stateful
component (engine, trainer, data feed) owns its ``state_dict()``; this module only
places the states by where they live, writes and verifies them. A checkpoint is a
directory per optimizer step::

    RUN/checkpoints/step-00000100/
        model-tp00-of-02.pt   fp32 weights of TP rank 0 (complete over DP): ``shard``
        optim-tp00-of-02.pt   its Adam moments, where they are kept apart (``files.write_shard``: reshard);
                              otherwise the model file holds them beside the weights
        model-tp01-of-02.pt   ... one pair per TP rank, written by that TP rank's first DP rank
        rank-00000.pt         what only this rank holds (the torch RNG): ``rank``
        tokenizer.model       the sentencepiece model, so that one directory is enough to translate
        meta.json             written last: step, config, layout, ``run`` (states equal on every
                              rank: engine counters, trainer), ``replicas`` (every rank's data-feed
                              state) and every file with its size and sha256
    RUN/checkpoints/latest    the newest complete step, replaced atomically
    RUN/checkpoints/best      the step with the best validation BLEU so far (pruning never deletes it)

Files are written into a hidden ``.step-*.tmp`` directory that becomes ``step-*`` only
after every rank has finished and ``meta.json`` is complete, so a job killed mid-save
leaves nothing that looks complete. Every read checks the file's sha256 against
``meta.json`` (a damaged file is an error naming it) and unpickles nothing but tensors
and plain containers (``weights_only=True``). Looking for the newest checkpoint skips
damaged ones and says which and why.

Model files hold each tensor at its TP shape: a different TP size merges the shards
(:func:`megaformer.parallel.sharding.merge_shards`) and splits them again; a
different DP size or ZeRO stage needs nothing, since the state is complete over DP.

The modules: :mod:`~megaformer.checkpoint.format` (names, ``meta.json``, finding a
checkpoint, pruning), :mod:`~megaformer.checkpoint.save`, :mod:`~megaformer.checkpoint.load`
(for training), :mod:`~megaformer.checkpoint.source` (any path a user gives, located and
verified once: :func:`locate`), :mod:`~megaformer.checkpoint.consolidated` (one TP-independent model:
reading for inference, resharding), :mod:`~megaformer.checkpoint.average`, and
:mod:`~megaformer.checkpoint.files` (checksummed, tensor-only reads).
"""

from megaformer.lazy import lazy_names

# Imported on first use (PEP 562), as megaformer.parallel's names: ``megaformer train``'s launching process
# reads checkpoint names and meta.json (:mod:`megaformer.checkpoint.format`: json and pathlib) and never
# imports torch itself.
_EXPORTS = {
    ".average": ("average_checkpoints", "last_checkpoints"),
    ".consolidated": (
        "CONSOLIDATED_FORMAT",
        "Consolidated",
        "consolidate",
        "load_consolidated",
        "load_for_inference",
        "read_model",
        "reshard",
        "save_consolidated",
    ),
    ".files": ("MODEL_KEYS", "OPTIMIZER_KEYS", "load_checked", "safe_torch_load", "write_shard"),
    ".format": (
        "CHECKPOINT_FORMAT",
        "META_KEYS",
        "META_TYPES",
        "POINTERS",
        "STEP_DIR",
        "TENSOR_KEYS",
        "Log",
        "check_complete",
        "check_files",
        "checked_meta",
        "check_step_name",
        "checkpoint_root",
        "find_latest",
        "list_checkpoints",
        "model_file_name",
        "model_files",
        "model_names",
        "optimizer_file_name",
        "prune",
        "rank_file_name",
        "read_pointer",
        "resolve_checkpoint",
        "step_dir_name",
        "verify_all",
        "write_best",
    ),
    ".load": (
        "LoadedCheckpoint",
        "changed_since",
        "check_same_model",
        "check_same_tokenizer",
        "layout_change",
        "load_checkpoint",
        "merged_state",
        "read_shard",
        "shape_info",
        "shard_info_of",
    ),
    ".source": ("CheckpointSource", "SourceCheck", "is_export", "locate"),
    ".save": ("CheckpointState", "file_entries", "save_checkpoint"),
    "megaformer.files": ("atomic_torch_save", "atomic_write_text", "sha256_of"),
}
_MODULE_OF, __getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
__all__ = sorted(_MODULE_OF)
