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

from megaformer.checkpoint.files import safe_torch_load, write_shard
from megaformer.checkpoint.format import STEP_DIR, Log, list_checkpoints, model_file_name
from megaformer.checkpoint.load import merged_state, shape_info, vocab_rows
from megaformer.checkpoint.save import file_entries
from megaformer.checkpoint.source import CheckpointSource, SourceCheck, locate
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
    """A consolidated model from a model file, a step directory, a ``best``/``latest`` file or a run directory.

    Exports are read by :func:`megaformer.decode.loading.load_model_file`, which reads every kind.
    """
    source = locate(path, log)
    if source.kind == "export":
        raise CheckpointError(f"{path}: an export: read it with megaformer.decode.loading.load_model_file")
    return read_model(source)


def read_model(source: CheckpointSource) -> Consolidated:
    """The model of a located step directory or model file: the weights only (a checkpoint's optimizer files
    are not opened; the moments an older model file holds beside the weights are never read)."""
    if source.kind == "model":
        return load_consolidated(source.path)
    if source.kind != "step":
        raise CheckpointError(f"{source.path}: an export, not a checkpoint or model file")
    meta, step_dir = source.meta, source.path
    state = merged_state(step_dir, meta, shape_info(meta), keys=("param",), read=source.weights)["param"]
    tok = step_dir / "tokenizer.model"
    if tok.name in meta["files"]:
        tokenizer = source.file(tok.name).read_bytes()
    else:  # a checkpoint whose meta.json lists none
        tokenizer = tok.read_bytes() if tok.is_file() else None
    trainer = meta["run"].get("trainer", {})
    return Consolidated(
        from_dict(meta["config"]),
        state,
        meta["vocab_size"],
        tokenizer,
        {"step": meta["step"], "tokens": trainer.get("tokens"), "source": str(step_dir)},
    )


def consolidate(step_dir: Path | CheckpointSource) -> Consolidated:
    """One TP-independent model from a (possibly TP-sharded) training checkpoint: its weights only."""
    if isinstance(step_dir, CheckpointSource):
        return read_model(step_dir)
    check = SourceCheck()
    check(Path(step_dir))
    return read_model(check.source(Path(step_dir)))


# ---- resharding ----------------------------------------------------------------------------------


def reshard(src: Path | CheckpointSource, out: Path, tp: int, log: Log) -> Path:
    """Write checkpoint ``src`` with its model files split for ``tp`` ranks (no processes needed).

    ``src``: a path, or a source :func:`locate` found with ``everything`` (its files verified
    once, not again). The model files are written with the Adam moments in optimizer files
    beside them (:func:`megaformer.checkpoint.files.write_shard`). The result is written beside
    its target and renamed into place at the end; the source is never written to, and an
    existing target (the source or another checkpoint) is refused rather than replaced.
    """
    from megaformer.parallel.layout import check_model_split

    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise CheckpointError(f"reshard: tp must be a positive integer, got {tp!r}")
    source = src if isinstance(src, CheckpointSource) else locate(src, log, everything=True)
    src, meta = source.path, source.meta
    cfg = from_dict(meta["config"])
    check_model_split(cfg.model, tp, "--tp")
    target = out if STEP_DIR.match(out.name) else out / src.name
    if target.resolve() == src.resolve():
        raise CheckpointError(f"reshard: {target} is the checkpoint being read; write to another folder")
    if target.exists():
        raise CheckpointError(f"reshard: {target} already exists; choose another output or remove it first")
    info = shape_info(meta)
    full = merged_state(src, meta, info, read=source.tensors)
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
        write_shard(part, tmp / model_file_name(r, tp))
    for name in meta["files"]:  # rank files and the tokenizer are carried as they are
        if name.startswith("rank-") or name == "tokenizer.model":
            shutil.copyfile(src / name, tmp / name)
    new_meta = dict(meta)
    new_meta["layout"] = {"tp": tp, "dp": meta["layout"]["dp"], "pp": 1, "world": tp * meta["layout"]["dp"]}
    parallel = {**meta["config"]["parallel"], "tp": tp, "dp": 0, "pp": 1, "pp_split": ""}
    new_meta["config"] = {**meta["config"], "parallel": parallel}
    new_meta["files"] = file_entries(tmp)
    atomic_write_text(tmp / "meta.json", json.dumps(new_meta, indent=1))
