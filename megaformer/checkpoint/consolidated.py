"""One TP-independent model (:class:`Consolidated`): its file, and making it from a checkpoint; resharding.

A *consolidated* model file holds every parameter at its TP=1 shape, the config, the
real vocabulary size and the sentencepiece model's bytes, so that one file is enough to
translate at any TP size.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megaformer.checkpoint.files import safe_torch_load
from megaformer.checkpoint.format import (
    POINTERS,
    STEP_DIR,
    Log,
    check_complete,
    list_checkpoints,
    model_file_name,
    resolve_checkpoint,
)
from megaformer.checkpoint.load import merged_state, shape_info, vocab_rows
from megaformer.checkpoint.save import file_entries
from megaformer.config import Config, from_dict, to_dict
from megaformer.errors import CheckpointError
from megaformer.files import atomic_output, atomic_torch_save, atomic_write_text

CONSOLIDATED_FORMAT = "megaformer-consolidated-v1"


@dataclass
class Consolidated:
    """One TP-independent model: config, full parameters, tokenizer."""

    config: Config
    model: dict[str, torch.Tensor]  # names of Transformer.named_parameters(), TP=1 shapes
    vocab_size: int
    tokenizer: bytes | None = None  # serialized sentencepiece model
    meta: dict = field(default_factory=dict)  # step, tokens seen, source checkpoints ...


def save_consolidated(path: str | Path, model: Consolidated) -> None:
    atomic_torch_save(
        {
            "format": CONSOLIDATED_FORMAT,
            "config": to_dict(model.config),
            "model": {k: v.detach().cpu().float() for k, v in model.model.items()},
            "vocab_size": model.vocab_size,
            "tokenizer": model.tokenizer,
            "meta": model.meta,
        },
        path,
    )


def load_consolidated(path: str | Path) -> Consolidated:
    """Read a consolidated model file; a clear error if it is missing, damaged or of another kind."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such model file")
    obj = safe_torch_load(path)
    if not isinstance(obj, dict) or obj.get("format") != CONSOLIDATED_FORMAT:
        raise CheckpointError(f"{path}: not a consolidated megaformer model (expected format {CONSOLIDATED_FORMAT})")
    return Consolidated(
        from_dict(obj["config"]), obj["model"], obj["vocab_size"], obj.get("tokenizer"), obj.get("meta", {})
    )


def load_for_inference(path: str | Path, log: Log) -> Consolidated:
    """A consolidated model from a model file, a step directory, a ``best``/``latest`` file or a run directory."""
    path = Path(path)
    if path.is_file() and path.name in POINTERS:
        return consolidate(resolve_checkpoint(path, log))
    if path.is_file():
        return load_consolidated(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint or model file")
    return consolidate(resolve_checkpoint(path, log))


def consolidate(step_dir: Path) -> Consolidated:
    """One TP-independent model from a (possibly TP-sharded) training checkpoint."""
    meta = check_complete(step_dir)
    state = merged_state(step_dir, meta, shape_info(meta), keys=("param",))["param"]
    tok = step_dir / "tokenizer.model"
    trainer = meta["run"].get("trainer", {})
    return Consolidated(
        from_dict(meta["config"]),
        state,
        meta["vocab_size"],
        tok.read_bytes() if tok.is_file() else None,
        {"step": meta["step"], "tokens": trainer.get("tokens"), "source": str(step_dir)},
    )


# ---- resharding ----------------------------------------------------------------------------------


def reshard(src: Path, out: Path, tp: int, log: Log) -> Path:
    """Write checkpoint ``src`` with its model files split for ``tp`` ranks (no processes needed).

    The result is written beside its target and renamed into place at the end; the
    source is never written to, and an existing target (the source or another
    checkpoint) is refused rather than replaced.
    """
    from megaformer.parallel.layout import check_model_split

    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise CheckpointError(f"reshard: tp must be a positive integer, got {tp!r}")
    src = resolve_checkpoint(src, log)
    meta = check_complete(src)
    cfg = from_dict(meta["config"])
    check_model_split(cfg.model, tp, "--tp")
    target = out if STEP_DIR.match(out.name) else out / src.name
    if target.resolve() == src.resolve():
        raise CheckpointError(f"reshard: {target} is the checkpoint being read; write to another folder")
    if target.exists():
        raise CheckpointError(f"reshard: {target} already exists; choose another output or remove it first")
    info = shape_info(meta)
    full = merged_state(src, meta, info)
    with atomic_output(target) as tmp:
        _write_resharded(src, tmp, meta, info, full, tp)
    if list_checkpoints(target.parent)[0] == target:  # `latest` names the newest step of its folder
        atomic_write_text(target.parent / "latest", target.name + "\n")
    return target


def _write_resharded(src: Path, tmp: Path, meta: dict, info: dict, full: dict, tp: int) -> None:
    """The TP shards of the merged ``full`` state, the carried rank files and tokenizer, and meta.json (last)."""
    from megaformer.parallel import TPGroup
    from megaformer.parallel.sharding import fit_vocab_rows, shard_full

    rows = vocab_rows(meta, tp)
    for r in range(tp):
        group = TPGroup(group=None, size=tp, rank=r)
        part = {
            key: {n: shard_full(fit_vocab_rows(n, t, rows), *info[n], group).clone() for n, t in ts.items()}
            for key, ts in full.items()
        }
        atomic_torch_save(part, tmp / model_file_name(r, tp))
    for name in meta["files"]:  # rank files and the tokenizer are carried as they are
        if name.startswith("rank-") or name == "tokenizer.model":
            shutil.copyfile(src / name, tmp / name)
    new_meta = dict(meta)
    new_meta["layout"] = {"tp": tp, "dp": meta["layout"]["dp"], "pp": 1, "world": tp * meta["layout"]["dp"]}
    parallel = {**meta["config"]["parallel"], "tp": tp, "dp": 0, "pp": 1, "pp_split": ""}
    new_meta["config"] = {**meta["config"], "parallel": parallel}
    new_meta["files"] = file_entries(tmp)
    atomic_write_text(tmp / "meta.json", json.dumps(new_meta, indent=1))
