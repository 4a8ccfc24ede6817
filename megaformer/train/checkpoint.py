"""Checkpoints: collect the components' states, shard, write atomically with checksums, read back.

Read by ``decode/`` too: keep this module free of the training loop. Each stateful
component (engine, trainer, data feed) owns its ``state_dict()``; this module only
places the states by where they live, writes and verifies them. A checkpoint is a
directory per optimizer step::

    RUN/checkpoints/step-00000100/
        model-tp00-of-02.pt   fp32 weights and Adam moments of TP rank 0 (complete over DP): ``shard``
        model-tp01-of-02.pt   ... one file per TP rank, written by that TP rank's first DP rank
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

Checksummed, tensor-only reads and consolidated model files live in
:mod:`megaformer.train.files`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megaformer.config import from_dict
from megaformer.errors import CheckpointError
from megaformer.train.files import (  # noqa: F401 - the checkpoint API's file-level names
    CONSOLIDATED_FORMAT,
    Consolidated,
    atomic_torch_save,
    atomic_write_text,
    load_consolidated,
    safe_torch_load,
    save_consolidated,
    sha256_of,
)

CHECKPOINT_FORMAT = "megaformer-checkpoint-v2"
STEP_DIR = re.compile(r"^step-(\d+)$")
META_KEYS = ("format", "step", "layout", "rank_layout", "config", "vocab_size", "run", "replicas", "files")
TENSOR_KEYS = ("param", "exp_avg", "exp_avg_sq")
POINTERS = ("latest", "best")  # files in a checkpoints folder that name one of its step directories

Log = Callable[[str], None]


# ---- finding checkpoints -----------------------------------------------------------------------


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def check_step_name(path: Path, step: int | None, option: str = "--out") -> None:
    """Refuse to write a checkpoint of ``step`` under a ``step-N`` name that says another step."""
    named = STEP_DIR.match(Path(path).name)
    if named and int(named.group(1)) != step:
        raise CheckpointError(
            f"{option} {path}: its name says step {int(named.group(1))}, but what is written is step {step}: "
            f"name it {step_dir_name(step) if step is not None else 'otherwise'} or use a name that is not step-N"
        )


def model_file_name(tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1) -> str:
    """``model-tp00-of-02.pt``; a pipelined run's stages ``model-pp01-of-04-tp00-of-02.pt``."""
    stage = f"pp{pp_rank:02d}-of-{pp_size:02d}-" if pp_size > 1 else ""
    return f"model-{stage}tp{tp_rank:02d}-of-{tp_size:02d}.pt"


def _model_files(meta: dict) -> list[list[str]]:
    """The model files of a checkpoint: one list of TP shards per pipeline stage."""
    tp, pp = meta["layout"]["tp"], meta["layout"].get("pp", 1)
    return [[model_file_name(r, tp, s, pp) for r in range(tp)] for s in range(pp)]


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def check_complete(step_dir: Path, verify: bool = False) -> dict:
    """``meta.json`` of a complete checkpoint; raises :class:`CheckpointError` saying what is wrong.

    Sizes are always checked; with ``verify`` every file's sha256 too.
    """
    meta_path = step_dir / "meta.json"
    if not meta_path.is_file():
        raise CheckpointError(f"{step_dir}: no meta.json (the save did not finish)")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{meta_path}: unreadable ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointError(f"{meta_path}: format {found!r}, this megaformer reads {CHECKPOINT_FORMAT}")
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise CheckpointError(f"{meta_path}: lacks {', '.join(missing)} (edited or written by another program)")
    named = STEP_DIR.match(step_dir.name)
    if not isinstance(meta["step"], int) or isinstance(meta["step"], bool) or meta["step"] < 0:
        raise CheckpointError(f"{meta_path}: step {meta['step']!r} is not a step count (edited by hand?)")
    if named and int(named.group(1)) != meta["step"]:
        raise CheckpointError(
            f"{step_dir}: its name says step {int(named.group(1))}, its meta.json step {meta['step']} "
            f"(renamed, or written there by hand): rename it {step_dir_name(meta['step'])} or move it out"
        )
    _check_meta_types(meta, meta_path)
    for name, entry in meta["files"].items():
        f = step_dir / name
        if not f.is_file():
            raise CheckpointError(f"{step_dir}: {name} is missing")
        if f.stat().st_size != entry["bytes"]:
            raise CheckpointError(f"{step_dir}: {name} has {f.stat().st_size} bytes, meta.json says {entry['bytes']}")
        if verify and sha256_of(f) != entry["sha256"]:
            raise CheckpointError(f"{f}: content does not match its sha256 in meta.json (the file is damaged)")
    return meta


# The fields of meta.json that readers index, and the JSON kind each must be.
META_TYPES = dict(layout=dict, rank_layout=dict, config=dict, vocab_size=int, run=dict, replicas=list, files=dict)


def _check_meta_types(meta: dict, meta_path: Path) -> None:
    """A hand-edited field of the wrong kind is one line naming it, not a KeyError or TypeError later."""

    def expect(name: str, value: object, kind: type, least: int = 0) -> None:
        if isinstance(value, bool) or not isinstance(value, kind) or (kind is int and value < least):
            floor = f" >= {least}" if kind is int else ""
            raise CheckpointError(f"{meta_path}: {name} is {value!r:.40}, expected {kind.__name__}{floor} (edited?)")

    for key, kind in META_TYPES.items():
        expect(key, meta[key], kind, least=1)
    for key, size in [(key, size) for key in ("layout", "rank_layout") for size in ("tp", "dp", "pp")]:
        expect(f"{key}.{size}", meta[key].get(size, 1), int, least=1)
    for key in ("config", "run", "files"):  # config sections; a value inside one is from_dict's to name
        for name, entry in meta[key].items():
            expect(f"{key}.{name}", entry, dict)
    for name, entry in meta["files"].items():
        expect(f"files.{name}.bytes", entry.get("bytes"), int)
        expect(f"files.{name}.sha256", entry.get("sha256"), str)


def list_checkpoints(root: Path) -> list[Path]:
    """Step directories under ``root``, newest first (complete or not)."""
    if not root.is_dir():
        return []
    steps = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(steps, reverse=True)]


def checkpoint_root(path: Path) -> Path:
    """The folder holding ``step-*`` directories, given a run directory or that folder itself."""
    return path / "checkpoints" if (path / "checkpoints").is_dir() else path


def find_latest(path: str | Path, log: Log) -> Path | None:
    """The newest complete, undamaged checkpoint under a run directory (or its checkpoints folder).

    Unfinished, torn or damaged ones are skipped, each with a line through ``log``
    naming it and why, so that falling back to an older step is never silent.
    """
    root = checkpoint_root(Path(path))
    if root.is_dir():
        for partial in sorted(root.glob(".step-*.tmp")):
            log(f"checkpoint: ignoring unfinished {partial.name} (a save that did not complete)")
    skipped = []
    for step_dir in list_checkpoints(root):
        try:
            check_complete(step_dir, verify=True)
        except CheckpointError as err:
            log(f"checkpoint: skipping {err}")
            skipped.append(step_dir.name)
            continue
        if skipped:
            log(f"checkpoint: using the older checkpoint {step_dir.name}, since {', '.join(skipped)} cannot be used")
        latest = read_pointer(root / "latest")
        if latest is not None and _step_of(latest) < _step_of(step_dir.name) and not skipped:
            log(f"checkpoint: latest names {latest}; the newer {step_dir.name} is complete (saved, latest not updated)")
        return step_dir
    return None


def _step_of(name: str) -> int:
    return int(STEP_DIR.match(name).group(1))


def read_pointer(path: Path) -> str | None:
    """The step directory name held by a ``latest`` or ``best`` file, or None if there is none."""
    try:
        name = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if STEP_DIR.match(name) else None


def write_best(root: Path, step_dir: Path) -> None:
    """Record ``step_dir`` (a step directory under ``root``) as the best checkpoint, atomically."""
    atomic_write_text(root / "best", step_dir.name + "\n")


def resolve_checkpoint(path: str | Path, log: Log) -> Path:
    """A verified step directory from a step directory, a ``best``/``latest`` file, a checkpoints folder or a run."""
    path = Path(path)
    if path.is_file() and path.name in POINTERS:
        name = read_pointer(path)
        if name is None:
            raise CheckpointError(f"{path}: does not name a step directory")
        path = path.parent / name
    if STEP_DIR.match(path.name):
        check_complete(path, verify=True)
        return path
    found = find_latest(path, log)
    if found is None:
        raise CheckpointError(f"{path}: no complete checkpoint found")
    return found


# ---- model shards -------------------------------------------------------------------------------


def read_shard(step_dir: Path, meta: dict, name: str) -> dict:
    """One file of a checkpoint, its sha256 checked against ``meta``."""
    entry = meta["files"].get(name)
    if entry is None:
        raise CheckpointError(f"{step_dir}: meta.json lists no {name}")
    return safe_torch_load(step_dir / name, entry["sha256"])


def shard_info_of(model: torch.nn.Module) -> dict[str, tuple[int | None, int]]:
    """Each parameter's (split dimension, stacked blocks), from its TP tags."""
    from megaformer.parallel import tp_dim, tp_partitions

    return {n: (tp_dim(p), tp_partitions(p)) for n, p in model.named_parameters()}


def merged_state(
    step_dir: Path, meta: dict, shard_info: dict[str, tuple[int | None, int]], keys: tuple[str, ...] = TENSOR_KEYS
) -> dict[str, dict[str, torch.Tensor]]:
    """Every tensor of the checkpoint at its TP=1 shape; ``shard_info`` maps a name to (tp_dim, partitions)."""
    from megaformer.parallel.sharding import merge_shards

    out: dict[str, dict[str, torch.Tensor]] = {key: {} for key in keys}
    for stage in _model_files(meta):  # a pipelined run's stages hold disjoint sets of names
        shards = [read_shard(step_dir, meta, name) for name in stage]
        for key in keys:
            for name in shards[0][key]:
                dim, partitions = shard_info.get(name, (None, 1))
                out[key][name] = merge_shards([s[key][name] for s in shards], dim, partitions)
    return out


def _shape_info(meta: dict) -> dict[str, tuple[int | None, int]]:
    from megaformer.model import shape_model

    return shard_info_of(shape_model(from_dict(meta["config"]), meta["vocab_size"]))


def prune(root: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` step directories and any leftover temporaries.

    The step named in ``root/best`` is kept whatever its age.
    """
    for stale in root.glob(".step-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    if keep_last > 0:
        best = read_pointer(root / "best")
        for old in list_checkpoints(root)[keep_last:]:
            if old.name != best:
                shutil.rmtree(old, ignore_errors=True)


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
    state = merged_state(step_dir, meta, _shape_info(meta), keys=("param",))["param"]
    tok = step_dir / "tokenizer.model"
    trainer = meta["run"].get("trainer", {})
    return Consolidated(
        from_dict(meta["config"]),
        state,
        meta["vocab_size"],
        tok.read_bytes() if tok.is_file() else None,
        {"step": meta["step"], "tokens": trainer.get("tokens"), "source": str(step_dir)},
    )


# ---- saving -------------------------------------------------------------------------------------


@dataclass
class CheckpointState:
    """What one rank hands to :func:`save_checkpoint`, by where it lives.

    ``shard``: tensors at this rank's TP shape, complete over DP (the engine's);
    ``run``: states equal on every rank (engine counters, trainer), written once;
    ``replica``: states that differ between ranks but are small (the data feed), every
    rank's kept in meta.json; ``rank``: this rank's own bulky state (the torch RNG).
    """

    shard: dict[str, dict[str, torch.Tensor]]
    run: dict[str, dict]
    replica: dict[str, dict]
    rank: dict[str, object]


def _barrier(ctx) -> None:
    if dist.is_initialized():
        dist.barrier(group=ctx.world_group)


def _file_entries(folder: Path) -> dict[str, dict]:
    return {p.name: {"bytes": p.stat().st_size, "sha256": sha256_of(p)} for p in sorted(folder.iterdir())}


def _finite_or_refuse(shard: dict[str, dict[str, torch.Tensor]], step: int) -> None:
    bad = [n for n, t in shard["param"].items() if not bool(torch.isfinite(t).all())]
    if bad:
        raise CheckpointError(
            f"step {step}: {len(bad)} parameters hold inf or NaN (first: {bad[0]}): not saving a broken model"
        )


def save_checkpoint(
    root: Path, step: int, ctx, state: CheckpointState, meta: dict, keep_last: int, tokenizer: Path | None = None
) -> Path:
    """Write one checkpoint; every rank calls this (it holds barriers over ``ctx``'s world).

    ``state.shard`` is written by the first DP rank of each TP rank, ``state.rank`` by
    every rank; ``state.replica`` of every rank is gathered into ``meta.json``, which
    rank 0 writes last (with every file's sha256) before the directory is renamed into
    place and ``latest`` replaced (and ``best``, when ``meta["best"]``), then older steps pruned.
    Refuses, on every rank, a model that is not finite.
    """
    _finite_or_refuse(state.shard, step)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = root / f".{step_dir_name(step)}.tmp"
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(ctx)
    with _writing(tmp):
        if ctx.dp_rank == 0:
            name = model_file_name(ctx.tp.rank, ctx.layout.tp, ctx.pp_rank, ctx.pp_size)
            atomic_torch_save(state.shard, tmp / name)
        atomic_torch_save(state.rank, tmp / rank_file_name(ctx.rank))
    replicas = [None] * ctx.layout.world_size
    if dist.is_initialized():
        dist.all_gather_object(replicas, state.replica, group=ctx.world_group)
    else:
        replicas = [state.replica]
    _barrier(ctx)  # every shard is on disk
    if ctx.is_main:
        layout = {"tp": ctx.layout.tp, "dp": ctx.layout.dp, "pp": ctx.pp_size, "world": ctx.layout.world_size}
        meta = dict(meta)
        stages = meta.pop("stages", None)
        best = meta.pop("best", False)  # name this step in root/best (kept by prune)
        if stages is not None:
            layout["stages"] = stages
        full_meta = {
            **meta,
            "format": CHECKPOINT_FORMAT,
            "step": step,
            "layout": layout,
            "rank_layout": layout,  # the layout of rank files and replicas (kept by reshard)
            "run": state.run,
            "replicas": replicas,
        }
        with _writing(tmp):
            _publish(tmp, final, full_meta, tokenizer)
            if best:
                write_best(root, final)
            prune(root, keep_last)
    _barrier(ctx)
    return final


@contextmanager
def _writing(tmp: Path) -> Iterator[None]:
    """Turn a failed write (a full disk, a quota, a vanished folder) into one line; the unfinished save is removed.

    torch reports a full disk as a RuntimeError from its zip writer ("unexpected pos").
    The checkpoints saved before are untouched: a save only becomes visible by its rename.
    """
    try:
        yield
    except (OSError, RuntimeError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = getattr(err, "strerror", None) or str(err).splitlines()[0]
        raise CheckpointError(
            f"{tmp.parent}: cannot write the checkpoint ({reason}): free space there or point --run-dir elsewhere; "
            f"the earlier checkpoints are intact"
        ) from None


def _publish(tmp: Path, final: Path, meta: dict, tokenizer: Path | None) -> None:
    """The tokenizer, then meta.json with every file's sha256 (last), the rename into place, ``latest``."""
    if tokenizer is not None and Path(tokenizer).is_file():
        shutil.copyfile(tokenizer, tmp / "tokenizer.model")
    atomic_write_text(tmp / "meta.json", json.dumps({**meta, "files": _file_entries(tmp)}, indent=1))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write_text(final.parent / "latest", final.name + "\n")


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


def load_checkpoint(step_dir: Path, ctx, model: torch.nn.Module, stages: list[int] | None = None) -> LoadedCheckpoint:
    """Read ``step_dir`` for this rank: the same layout reads its own shard, another merges and re-splits.

    ``stages``: layers per pipeline stage of this run (None without a pipeline); a
    checkpoint cut otherwise (another pp or pp_split) is merged and this stage's layers taken.
    """
    from megaformer.parallel.sharding import shard_full

    meta = check_complete(step_dir)
    old = meta["layout"]
    names = {n for n, _ in model.named_parameters()}
    same_cut = old.get("pp", 1) == ctx.pp_size and old.get("stages") == stages
    if old["tp"] == ctx.layout.tp and same_cut:
        shard = read_shard(step_dir, meta, model_file_name(ctx.tp.rank, old["tp"], ctx.pp_rank, ctx.pp_size))
    else:  # another TP size or pipeline cut: merge every shard, keep this stage's names, split for this TP rank
        info = shard_info_of(model)
        full = merged_state(step_dir, meta, info)
        shard = {
            key: {n: shard_full(t, *info[n], ctx.tp) for n, t in tensors.items() if n in names}
            for key, tensors in full.items()
        }
    if set(shard["param"]) != names:
        missing, extra = sorted(names - set(shard["param"])), sorted(set(shard["param"]) - names)
        raise CheckpointError(
            f"{step_dir}: does not match the model (missing {missing[:3]}, unexpected {extra[:3]}); "
            f"was it written with another model.* config?"
        )
    rl = meta["rank_layout"]
    rank = None
    if ctx.dp_rank < rl["dp"] and ctx.tp.rank < rl["tp"] and ctx.pp_rank < rl.get("pp", 1):
        name = rank_file_name((ctx.pp_rank * rl["dp"] + ctx.dp_rank) * rl["tp"] + ctx.tp.rank)
        if name in meta["files"]:
            rank = read_shard(step_dir, meta, name)
    return LoadedCheckpoint(meta, shard, rank)


# ---- resharding ----------------------------------------------------------------------------------


def reshard(src: Path, out: Path, tp: int, log: Log) -> Path:
    """Write checkpoint ``src`` with its model files split for ``tp`` ranks (no processes needed).

    The result is written beside its target and renamed into place at the end; the
    source is never written to, and an existing target (the source or another
    checkpoint) is refused rather than replaced.
    """
    from megaformer.parallel import TPGroup
    from megaformer.parallel.layout import check_model_split
    from megaformer.parallel.sharding import shard_full

    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise CheckpointError(f"reshard: tp must be a positive integer, got {tp!r}")
    src = resolve_checkpoint(src, log)
    meta = check_complete(src)
    cfg = from_dict(meta["config"])
    check_model_split(cfg.model, tp)
    target = out if STEP_DIR.match(out.name) else out / src.name
    if target.resolve() == src.resolve():
        raise CheckpointError(f"reshard: {target} is the checkpoint being read; write to another folder")
    if target.exists():
        raise CheckpointError(f"reshard: {target} already exists; choose another output or remove it first")
    info = _shape_info(meta)
    full = merged_state(src, meta, info)
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for r in range(tp):
        group = TPGroup(group=None, size=tp, rank=r)
        part = {key: {n: shard_full(t, *info[n], group).clone() for n, t in ts.items()} for key, ts in full.items()}
        atomic_torch_save(part, tmp / model_file_name(r, tp))
    for name in meta["files"]:  # rank files and the tokenizer are carried as they are
        if name.startswith("rank-") or name == "tokenizer.model":
            shutil.copyfile(src / name, tmp / name)
    new_meta = dict(meta)
    new_meta["layout"] = {"tp": tp, "dp": meta["layout"]["dp"], "pp": 1, "world": tp * meta["layout"]["dp"]}
    parallel = {**meta["config"]["parallel"], "tp": tp, "dp": 0, "pp": 1, "pp_split": ""}
    new_meta["config"] = {**meta["config"], "parallel": parallel}
    new_meta["files"] = _file_entries(tmp)
    atomic_write_text(tmp / "meta.json", json.dumps(new_meta, indent=1))
    os.replace(tmp, target)
    atomic_write_text(target.parent / "latest", target.name + "\n")
    return target
