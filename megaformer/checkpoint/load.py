"""Reading a checkpoint back for training: this rank's shard at its TP shape, and the states around it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from megaformer.checkpoint.files import safe_torch_load
from megaformer.checkpoint.format import (
    TENSOR_KEYS,
    check_complete,
    model_file_name,
    model_files,
    optimizer_file_name,
    rank_file_name,
)
from megaformer.config import TRAINING_ONLY_MODEL_SETTINGS, from_dict, to_dict
from megaformer.errors import CheckpointError
from megaformer.files import sha256_of

# ---- model shards -------------------------------------------------------------------------------


def read_shard(step_dir: Path, meta: dict, name: str) -> dict:
    """One file of a checkpoint, its sha256 checked against ``meta``; a model file with the Adam moments of its
    optimizer file, where the checkpoint has one (:func:`megaformer.checkpoint.files.write_shard`)."""
    entry = meta["files"].get(name)
    if entry is None:
        raise CheckpointError(f"{step_dir}: meta.json lists no {name}")
    state = safe_torch_load(step_dir / name, entry["sha256"])
    optim = optimizer_file_name(name)
    if name.startswith("model-") and optim in meta["files"] and isinstance(state, dict):
        state = {**state, **safe_torch_load(step_dir / optim, meta["files"][optim]["sha256"])}
    return state


def shard_info_of(model: torch.nn.Module) -> dict[str, tuple[int | None, int]]:
    """Each parameter's (split dimension, stacked blocks), from its TP tags."""
    from megaformer.parallel import tp_dim, tp_partitions

    return {n: (tp_dim(p), tp_partitions(p)) for n, p in model.named_parameters()}


def merged_state(
    step_dir: Path,
    meta: dict,
    shard_info: dict[str, tuple[int | None, int]],
    keys: tuple[str, ...] = TENSOR_KEYS,
    read: Callable[[str], dict] | None = None,
) -> dict[str, dict[str, torch.Tensor]]:
    """Every tensor of the checkpoint at its TP=1 shape; ``shard_info`` maps a name to (tp_dim, partitions).

    ``read``: a model file's name -> its tensors (:func:`read_shard` by default; a located source's
    readers, which hash nothing twice, where the caller has one). The vocabulary's rows are cut to
    their TP=1 padding: a TP size that pads further (tp=3) wrote more, which no other TP size could take.
    """
    from megaformer.parallel.sharding import fit_vocab_rows, merge_shards

    rows = vocab_rows(meta, 1)
    out: dict[str, dict[str, torch.Tensor]] = {key: {} for key in keys}
    for stage in model_files(meta):  # a pipelined run's stages hold disjoint sets of names
        shards = [read(name) if read is not None else read_shard(step_dir, meta, name) for name in stage]
        for key in keys:
            for name in shards[0][key]:
                dim, partitions = shard_info.get(name, (None, 1))
                full = merge_shards([s[key][name] for s in shards], dim, partitions)
                out[key][name] = fit_vocab_rows(name, full, rows)
    return out


def vocab_rows(meta: dict, tp: int) -> int:
    """The embedding's rows (the vocabulary padded) of the checkpoint's model split over ``tp`` ranks."""
    from megaformer.parallel import padded_vocab_size

    return padded_vocab_size(meta["vocab_size"], tp, from_dict(meta["config"]).parallel.vocab_multiple)


def shape_info(meta: dict) -> dict[str, tuple[int | None, int]]:
    from megaformer.model import shape_model

    return shard_info_of(shape_model(from_dict(meta["config"]), meta["vocab_size"]))


# ---- loading for training ------------------------------------------------------------------------


@dataclass
class LoadedCheckpoint:
    """A checkpoint read back for one rank: its shard at this rank's TP shape, and the states around it."""

    meta: dict
    shard: dict[str, dict[str, torch.Tensor]]
    rank: dict | None  # this rank's rank file, if a rank at its (DP, TP) place existed

    @property
    def run(self) -> dict[str, dict]:
        return self.meta["run"]

    def replicas_of_dp_ranks(self) -> list[dict]:
        """The replica states of the first TP rank of every old DP rank (of the first stage: the stages
        of a replica read the same data and keep the same dropout positions)."""
        rl = self.meta["rank_layout"]
        return [self.meta["replicas"][d * rl["tp"]] for d in range(rl["dp"])]

    def replica_at(self, dp_rank: int, tp_rank: int) -> dict | None:
        """The replica state of the old rank at (``dp_rank``, ``tp_rank``) of the first stage, if it existed."""
        rl = self.meta["rank_layout"]
        if dp_rank < rl["dp"] and tp_rank < rl["tp"]:
            return self.meta["replicas"][dp_rank * rl["tp"] + tp_rank]
        return None


def _config_changes(saved: object, now: dict, keys) -> list[tuple[str, object, object]]:
    """("section.key", the checkpoint's value, this run's) for each (section, key) of ``keys`` whose values
    differ between a checkpoint's config (``saved``, as meta.json holds it) and ``now``; none where either
    side does not say."""
    if not isinstance(saved, dict):
        return []
    return [
        (f"{section}.{key}", saved[section][key], now[section][key])
        for section, key in keys
        if isinstance(saved.get(section), dict) and key in saved[section] and saved[section][key] != now[section][key]
    ]


def check_same_model(step_dir: Path, meta: dict, model_cfg: object) -> None:
    """A resume with other architecture settings (``model_cfg``, a ModelConfig) is refused, naming them,
    e.g. "model.norm='post' (this run: 'pre')"; those a resume may change (dropout) are left out.

    Refused before anything is read or written: the weights would not fit (widths), or would
    load and compute another function (heads, norm) without a word.
    """
    now = {"model": dataclasses.asdict(model_cfg)}
    keys = [("model", key) for key in now["model"] if key not in TRAINING_ONLY_MODEL_SETTINGS]
    if changes := _config_changes(meta.get("config"), now, keys):
        written = ", ".join(f"{name}={old!r} (this run: {new!r})" for name, old, new in changes)
        raise CheckpointError(
            f"{step_dir}: does not match the model: it was written with {written}: resume with the checkpoint's "
            f"settings, or train into another --run-dir"
        )


# Settings whose change the resume line does not list: the architecture's (refused by check_same_model),
# the layout's sizes (said beside the resume) and the data's direction (checked against the data at launch;
# checkpoints of before it was taken from the data hold the old default, en -> de, whatever the data was).
NOT_LISTED = frozenset(
    {("parallel", "tp"), ("parallel", "dp"), ("parallel", "pp"), ("data", "src_lang"), ("data", "tgt_lang")}
)


def changed_since(saved: dict | None, cfg: object) -> str:
    """Every setting but the layout's sizes that differs between a checkpoint's config and ``cfg``, e.g.
    "train.precision 'fp32' -> 'bf16', train.lr_scale 1.0 -> 5.0"; empty if none (or the checkpoint holds no config).

    A resume may change any setting but the architecture (the lr, the step's tokens, the
    seeds, the data): each one changed is named, so that none applies without a word.
    """
    now = to_dict(cfg)
    keys = [
        (section, key)
        for section, values in now.items()
        for key in values
        if (section, key) not in NOT_LISTED and (section != "model" or key in TRAINING_ONLY_MODEL_SETTINGS)
    ]
    return ", ".join(f"{name} {old!r} -> {new!r}" for name, old, new in _config_changes(saved, now, keys))


def layout_change(saved: dict, layout: object) -> str:
    """The change from a checkpoint's ``meta["layout"]`` to ``layout`` for the resume line; empty if none.

    E.g. ``, layout tp=1 dp=2 -> tp=2 dp=1``; pp is named only where either side has a pipeline.
    """
    before, after = (saved["tp"], saved["dp"], saved.get("pp", 1)), (layout.tp, layout.dp, layout.pp)
    names = ("tp", "dp", "pp") if max(before[2], after[2]) > 1 else ("tp", "dp")

    def say(sizes: tuple[int, ...]) -> str:
        return " ".join(f"{n}={v}" for n, v in zip(names, sizes, strict=False))

    return f", layout {say(before)} -> {say(after)}" if before != after else ""


def load_checkpoint(step_dir: Path, ctx, model: torch.nn.Module, stages: list[int] | None = None) -> LoadedCheckpoint:
    """Read ``step_dir`` for this rank: the same layout reads its own shard, another merges and re-splits.

    ``stages``: layers per pipeline stage of this run (None without a pipeline); a
    checkpoint cut otherwise (another pp or pp_split) is merged and this stage's layers taken.
    The caller has checked the model's settings (:func:`check_same_model`, before the run
    directory is written); names and shapes are checked here.
    """
    from megaformer.parallel.sharding import fit_vocab_rows, shard_full

    meta = check_complete(step_dir)
    old = meta["layout"]
    names = {n for n, _ in model.named_parameters()}
    same_cut = old.get("pp", 1) == ctx.pp_size and old.get("stages") == stages
    if old["tp"] == ctx.layout.tp and same_cut:
        shard = read_shard(step_dir, meta, model_file_name(ctx.tp.rank, old["tp"], ctx.pp_rank, ctx.pp_size))
    else:  # another TP size or pipeline cut: merge every shard, keep this stage's names, split for this TP rank
        info = shard_info_of(model)
        full = merged_state(step_dir, meta, info)
        rows = {n: p.shape[0] * ctx.tp.size for n, p in model.named_parameters()}  # this TP size's padding
        shard = {
            key: {
                n: shard_full(fit_vocab_rows(n, t, rows[n]), *info[n], ctx.tp) for n, t in tensors.items() if n in names
            }
            for key, tensors in full.items()
        }
    if set(shard["param"]) != names:
        missing, extra = sorted(names - set(shard["param"])), sorted(set(shard["param"]) - names)
        raise CheckpointError(
            f"{step_dir}: does not match the model (missing {missing[:3]}, unexpected {extra[:3]}); "
            f"was it written with another model.* config?"
        )
    shapes = dict(model.named_parameters())
    if wrong := [n for n, t in shard["param"].items() if t.shape != shapes[n].shape]:
        raise CheckpointError(
            f"{step_dir}: does not match the model ({wrong[0]}: {tuple(shard['param'][wrong[0]].shape)} in the "
            f"checkpoint, {tuple(shapes[wrong[0]].shape)} here); was it written with another model.* config?"
        )
    rl = meta["rank_layout"]
    rank = None
    if ctx.dp_rank < rl["dp"] and ctx.tp.rank < rl["tp"] and ctx.pp_rank < rl.get("pp", 1):
        name = rank_file_name((ctx.pp_rank * rl["dp"] + ctx.dp_rank) * rl["tp"] + ctx.tp.rank)
        if name in meta["files"]:
            rank = read_shard(step_dir, meta, name)
    return LoadedCheckpoint(meta, shard, rank)


def check_same_tokenizer(step_dir: Path, meta: dict, manifest: dict, allowed: bool, log: Callable[[str], None]) -> None:
    """A resume on data made with another tokenizer or vocabulary is refused (unless ``allowed``, said in a line).

    The ids of the new data would mean other pieces to the model; a different vocabulary
    size cannot be loaded at all.
    """
    tok = manifest["tokenizer"]
    if meta.get("vocab_size") != tok["vocab_size"]:
        raise CheckpointError(
            f"{step_dir}: trained with a vocabulary of {meta.get('vocab_size')} pieces, the data has "
            f"{tok['vocab_size']}: resume on data prepared with the checkpoint's tokenizer ({step_dir}/tokenizer.model)"
        )
    saved = step_dir / "tokenizer.model"
    if not saved.is_file() or sha256_of(saved) == tok["sha256"]:
        return
    if not allowed:
        raise CheckpointError(
            f"{step_dir}: trained with another tokenizer than the data's ({saved} differs from the one in data.path): "
            f"prepare the data with --spm {saved}, or pass --other-tokenizer to resume anyway"
        )
    log(f"train: --other-tokenizer: resuming {step_dir} on data made with another tokenizer of the same size")
