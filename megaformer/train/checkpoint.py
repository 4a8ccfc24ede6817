"""Checkpoints: sharded, atomic save / load / reshard, and the consolidated model file.

Read by ``decode/`` too: keep this module free of the training loop.

A training checkpoint is a directory per optimizer step::

    RUN/checkpoints/step-00000100/
        model-tp00-of-02.pt   fp32 weights and Adam moments of TP rank 0 (complete over DP)
        model-tp01-of-02.pt   ... one file per TP rank, written by that TP rank's first DP rank
        rank-00000.pt         per-rank state: dropout and torch RNG streams
        tokenizer.model       the sentencepiece model, so that one directory is enough to translate
        meta.json             written last: step, tokens, config, layout, data-stream state of every
                              DP rank, loss scale, and every file with its size
    RUN/checkpoints/latest    the newest complete step, replaced atomically

Files are written into a hidden ``.step-*.tmp`` directory that becomes ``step-*`` only
after every rank has finished and ``meta.json`` is complete, so a job killed mid-save
leaves nothing that looks complete. Loading checks ``meta.json`` and the sizes of the
files it lists, and falls back to the newest complete checkpoint, saying so.

Model files hold each tensor at its TP shape: a different TP size merges the shards
(:func:`megaformer.parallel.sharding.merge_shards`) and splits them again; a
different DP size or ZeRO stage needs nothing, since the state is complete over DP.

A *consolidated* model file holds one TP-independent model (every parameter at its
TP=1 shape, as :func:`megaformer.parallel.gather_full` assembles it), the config, the
real vocabulary size and the sentencepiece model's bytes, so that a single file is
enough to translate at any TP size.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megaformer.config import Config, from_dict, to_dict
from megaformer.errors import CheckpointError

CONSOLIDATED_FORMAT = "megaformer-consolidated-v1"
CHECKPOINT_FORMAT = "megaformer-checkpoint-v1"
STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass
class Consolidated:
    """One TP-independent model: config, full parameters, tokenizer."""

    config: Config
    model: dict[str, torch.Tensor]  # names of Transformer.named_parameters(), TP=1 shapes
    vocab_size: int
    tokenizer: bytes | None = None  # serialized sentencepiece model
    meta: dict = field(default_factory=dict)  # step, tokens seen, source checkpoints ...


def atomic_torch_save(obj: object, path: str | Path) -> None:
    """Write ``obj`` to ``path`` through a temporary file in the same folder and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


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
    """Read a consolidated model file; a clear error if it is missing, torn or of another kind."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such model file")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # a torn or foreign file: say which, not a traceback
        raise CheckpointError(
            f"{path}: cannot be read as a megaformer model file ({type(err).__name__}: {err})"
        ) from None
    if not isinstance(obj, dict) or obj.get("format") != CONSOLIDATED_FORMAT:
        raise CheckpointError(f"{path}: not a consolidated megaformer model (expected format {CONSOLIDATED_FORMAT})")
    return Consolidated(
        from_dict(obj["config"]), obj["model"], obj["vocab_size"], obj.get("tokenizer"), obj.get("meta", {})
    )


# ---- training checkpoints --------------------------------------------------------------------


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def model_file_name(tp_rank: int, tp_size: int) -> str:
    return f"model-tp{tp_rank:02d}-of-{tp_size:02d}.pt"


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def check_complete(step_dir: Path) -> dict:
    """``meta.json`` of a complete checkpoint; raises :class:`CheckpointError` saying what is missing."""
    meta_path = step_dir / "meta.json"
    if not meta_path.is_file():
        raise CheckpointError(f"{step_dir}: no meta.json (the save did not finish)")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{meta_path}: unreadable ({err})") from None
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{meta_path}: not a megaformer checkpoint (format {meta.get('format')!r})")
    for name, size in meta.get("files", {}).items():
        f = step_dir / name
        if not f.is_file():
            raise CheckpointError(f"{step_dir}: {name} is missing")
        if f.stat().st_size != size:
            raise CheckpointError(f"{step_dir}: {name} has {f.stat().st_size} bytes, meta.json says {size}")
    return meta


def list_checkpoints(root: Path) -> list[Path]:
    """Step directories under ``root``, newest first (complete or not)."""
    if not root.is_dir():
        return []
    steps = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(steps, reverse=True)]


def checkpoint_root(path: Path) -> Path:
    """The folder holding ``step-*`` directories, given a run directory or that folder itself."""
    return path / "checkpoints" if (path / "checkpoints").is_dir() else path


def find_latest(path: str | Path, log=print) -> Path | None:
    """The newest complete checkpoint under a run directory (or its checkpoints folder).

    Torn or incomplete ones are skipped, each with a line through ``log``.
    """
    root = checkpoint_root(Path(path))
    if root.is_dir():
        for partial in sorted(root.glob(".step-*.tmp")):
            log(f"checkpoint: ignoring unfinished {partial.name} (a save that did not complete)")
    for step_dir in list_checkpoints(root):
        try:
            check_complete(step_dir)
            return step_dir
        except CheckpointError as err:
            log(f"checkpoint: skipping {err}")
    return None


def resolve_checkpoint(path: str | Path, log=print) -> Path:
    """A step directory from a step directory, a checkpoints folder or a run directory."""
    path = Path(path)
    if STEP_DIR.match(path.name):
        check_complete(path)
        return path
    found = find_latest(path, log)
    if found is None:
        raise CheckpointError(f"{path}: no complete checkpoint found")
    return found


def read_meta(step_dir: Path) -> dict:
    return check_complete(step_dir)


def load_model_file(step_dir: Path, name: str) -> dict:
    try:
        return torch.load(step_dir / name, map_location="cpu", weights_only=False)
    except Exception as err:  # a damaged file: say which
        raise CheckpointError(f"{step_dir / name}: cannot be read ({type(err).__name__}: {err})") from None


def merged_state(
    step_dir: Path,
    meta: dict,
    shard_info: dict[str, tuple[int | None, int]],
    keys: tuple[str, ...] = ("param", "exp_avg", "exp_avg_sq"),
) -> dict[str, dict[str, torch.Tensor]]:
    """Every tensor of the checkpoint at its TP=1 shape; ``shard_info`` maps a name to (tp_dim, partitions)."""
    from megaformer.parallel.sharding import merge_shards

    tp = meta["layout"]["tp"]
    shards = [load_model_file(step_dir, model_file_name(r, tp)) for r in range(tp)]
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key in keys:
        out[key] = {}
        for name in shards[0][key]:
            dim, partitions = shard_info.get(name, (None, 1))
            out[key][name] = merge_shards([s[key][name] for s in shards], dim, partitions)
    return out


def shard_info_of(model: torch.nn.Module) -> dict[str, tuple[int | None, int]]:
    return {n: (getattr(p, "tp_dim", None), getattr(p, "tp_partitions", 1)) for n, p in model.named_parameters()}


def prune(root: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` step directories and any leftover temporaries."""
    for stale in root.glob(".step-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    if keep_last > 0:
        for old in list_checkpoints(root)[keep_last:]:
            shutil.rmtree(old, ignore_errors=True)


def load_for_inference(path: str | Path) -> Consolidated:
    """A consolidated model from a model file, a step directory or a run directory."""
    path = Path(path)
    if path.is_file():
        return load_consolidated(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint or model file")
    step_dir = resolve_checkpoint(path, log=lambda msg: None)
    return consolidate(step_dir)


def consolidate(step_dir: Path) -> Consolidated:
    """One TP-independent model from a (possibly TP-sharded) training checkpoint."""
    from megaformer.model import Transformer
    from megaformer.parallel import LOCAL, DropoutRNG

    meta = read_meta(step_dir)
    cfg = from_dict(meta["config"])
    with torch.device("meta"):
        shape_model = Transformer(
            cfg.model, meta["vocab_size"], LOCAL, DropoutRNG(0, LOCAL), vocab_multiple=cfg.parallel.vocab_multiple
        )
    state = merged_state(step_dir, meta, shard_info_of(shape_model), keys=("param",))["param"]
    tok = step_dir / "tokenizer.model"
    return Consolidated(
        cfg,
        state,
        meta["vocab_size"],
        tok.read_bytes() if tok.is_file() else None,
        {"step": meta["step"], "tokens": meta.get("tokens"), "source": str(step_dir)},
    )


def _barrier(ctx) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(
    root: Path,
    step: int,
    ctx,
    model_state: dict[str, dict[str, torch.Tensor]],
    rank_state: dict,
    data_state: dict,
    meta: dict,
    keep_last: int,
    tokenizer: Path | None = None,
) -> Path:
    """Write one checkpoint; every rank calls this (it holds barriers).

    ``model_state`` is this rank's :func:`megaformer.train.engine.export_state`, written
    by the first DP rank of each TP rank; ``rank_state`` (RNG streams) by every rank;
    ``data_state`` (this DP rank's stream position) goes into ``meta.json``, which rank 0
    writes last, before the directory is renamed into place and ``latest`` replaced.
    """
    import torch.distributed as dist

    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = root / f".{step_dir_name(step)}.tmp"
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(ctx)
    if ctx.dp_rank == 0:
        atomic_torch_save(model_state, tmp / model_file_name(ctx.tp.rank, ctx.layout.tp))
    atomic_torch_save(rank_state, tmp / rank_file_name(ctx.rank))
    data_states = [None] * ctx.layout.world_size
    if dist.is_initialized():
        dist.all_gather_object(data_states, data_state)
    else:
        data_states = [data_state]
    _barrier(ctx)  # every shard is on disk
    if ctx.is_main:
        if tokenizer is not None and Path(tokenizer).is_file():
            shutil.copyfile(tokenizer, tmp / "tokenizer.model")
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        full_meta = {
            **meta,
            "format": CHECKPOINT_FORMAT,
            "step": step,
            "layout": {"tp": ctx.layout.tp, "dp": ctx.layout.dp, "world": ctx.layout.world_size},
            "rank_layout": {"tp": ctx.layout.tp, "dp": ctx.layout.dp, "world": ctx.layout.world_size},
            # TP peers read the same batches: one stream position per DP rank.
            "data_states": [data_states[d * ctx.layout.tp] for d in range(ctx.layout.dp)],
            "files": files,
        }
        atomic_write_text(tmp / "meta.json", json.dumps(full_meta, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        atomic_write_text(root / "latest", final.name + "\n")
        prune(root, keep_last)
    _barrier(ctx)
    return final


def load_checkpoint_state(
    step_dir: Path, ctx, model: torch.nn.Module
) -> tuple[dict, dict[str, dict[str, torch.Tensor]], dict | None]:
    """(meta, this rank's model/optimizer state at the current TP shape, this rank's RNG state or None).

    The same layout reads this rank's files; another TP size merges and re-splits the
    shards; RNG streams are carried where a rank with the same (DP, TP) position existed.
    """
    from megaformer.parallel.sharding import shard_full

    meta = read_meta(step_dir)
    old_tp = meta["layout"]["tp"]
    if old_tp == ctx.layout.tp:
        state = load_model_file(step_dir, model_file_name(ctx.tp.rank, old_tp))
    else:
        info = shard_info_of(model)
        full = merged_state(step_dir, meta, info)
        state = {key: {n: shard_full(t, *info[n], ctx.tp) for n, t in tensors.items()} for key, tensors in full.items()}
    names = {n for n, _ in model.named_parameters()}
    if set(state["param"]) != names:
        missing, extra = sorted(names - set(state["param"])), sorted(set(state["param"]) - names)
        raise CheckpointError(
            f"{step_dir}: does not match the model (missing {missing[:3]}, unexpected {extra[:3]}); "
            f"was it written with another model.* config?"
        )
    rl = meta["rank_layout"]
    old_rank = ctx.dp_rank * rl["tp"] + ctx.tp.rank
    rank_state = None
    if ctx.dp_rank < rl["dp"] and ctx.tp.rank < rl["tp"] and (step_dir / rank_file_name(old_rank)).is_file():
        rank_state = load_model_file(step_dir, rank_file_name(old_rank))
    return meta, state, rank_state


def reshard(src: Path, out: Path, tp: int) -> Path:
    """Write checkpoint ``src`` with its model files split for ``tp`` ranks (no processes needed)."""
    from megaformer.model import Transformer
    from megaformer.parallel import LOCAL, DropoutRNG, TPGroup
    from megaformer.parallel.layout import check_model_split
    from megaformer.parallel.sharding import shard_full

    src = resolve_checkpoint(src)
    meta = read_meta(src)
    cfg = from_dict(meta["config"])
    check_model_split(cfg.model, tp)
    with torch.device("meta"):
        shape_model = Transformer(
            cfg.model, meta["vocab_size"], LOCAL, DropoutRNG(0, LOCAL), vocab_multiple=cfg.parallel.vocab_multiple
        )
    info = shard_info_of(shape_model)
    full = merged_state(src, meta, info)
    target = out / src.name if not STEP_DIR.match(out.name) else out
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for r in range(tp):
        group = TPGroup(group=None, size=tp, rank=r)
        part = {
            key: {n: shard_full(t, *info[n], group).clone() for n, t in tensors.items()}
            for key, tensors in full.items()
        }
        atomic_torch_save(part, tmp / model_file_name(r, tp))
    for f in src.iterdir():  # rank files and the tokenizer are carried as they are
        if f.name.startswith("rank-") or f.name == "tokenizer.model":
            shutil.copyfile(f, tmp / f.name)
    new_meta = dict(meta)
    new_meta["layout"] = {"tp": tp, "dp": meta["layout"]["dp"], "world": tp * meta["layout"]["dp"]}
    new_meta["config"] = {**meta["config"], "parallel": {**meta["config"]["parallel"], "tp": tp, "dp": 0}}
    new_meta["files"] = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
    atomic_write_text(tmp / "meta.json", json.dumps(new_meta, indent=1))
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    atomic_write_text(target.parent / "latest", target.name + "\n")
    return target
