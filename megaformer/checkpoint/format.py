"""The checkpoint format: names, ``meta.json`` and its checks, finding and resolving step directories, pruning."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from megaformer.errors import CheckpointError
from megaformer.files import atomic_write_text, sha256_of

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


def model_files(meta: dict) -> list[list[str]]:
    """The model files of a checkpoint: one list of TP shards per pipeline stage."""
    tp, pp = meta["layout"]["tp"], meta["layout"].get("pp", 1)
    return [[model_file_name(r, tp, s, pp) for r in range(tp)] for s in range(pp)]


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def optimizer_file_name(model_file: str) -> str:
    """The optimizer file beside a model file: ``optim-tp00-of-02.pt`` for ``model-tp00-of-02.pt``."""
    return "optim-" + model_file.removeprefix("model-")


def model_names(meta: dict) -> list[str]:
    """The files a reader of the model alone needs: every model file and the tokenizer, never an optimizer file.

    A checkpoint that lists ``optim-*`` files keeps the Adam moments there and only the weights
    in its model files; one that does not (written before that layout) keeps all three in the model files.
    """
    names = [name for stage in model_files(meta) for name in stage]
    return names + (["tokenizer.model"] if "tokenizer.model" in meta["files"] else [])


def check_complete(step_dir: Path, verify: bool = False) -> dict:
    """``meta.json`` of a complete checkpoint; raises :class:`CheckpointError` saying what is wrong.

    Sizes are always checked; with ``verify`` every file's sha256 too.
    """
    meta = checked_meta(step_dir)
    check_files(step_dir, meta, list(meta["files"]), verify)
    return meta


def checked_meta(step_dir: Path) -> dict:
    """``meta.json`` of ``step_dir``, its keys, kinds and step checked; no file beside it is looked at."""
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
    return meta


def check_files(step_dir: Path, meta: dict, names: list[str], verify: bool) -> dict[str, tuple[int, ...]]:
    """Check that each of ``names`` is listed in ``meta``, present and of its size; with ``verify`` its sha256 too.

    Returns each verified file's :func:`file_stamp`, taken before it was hashed: a reader that
    finds the file with the same stamp later (another process too) need not hash it again.
    """
    stamps = {}
    for name in names:
        entry, f = meta["files"].get(name), step_dir / name
        if entry is None:
            raise CheckpointError(f"{step_dir}: meta.json lists no {name}")
        if not f.is_file():
            raise CheckpointError(f"{step_dir}: {name} is missing")
        if f.stat().st_size != entry["bytes"]:
            raise CheckpointError(f"{step_dir}: {name} has {f.stat().st_size} bytes, meta.json says {entry['bytes']}")
        if verify:
            stamps[name] = file_stamp(f)
            if sha256_of(f) != entry["sha256"]:
                raise CheckpointError(f"{f}: content does not match its sha256 in meta.json (the file is damaged)")
    return stamps


def file_stamp(path: Path) -> tuple[int, ...]:
    """(device, inode, size, mtime in ns): what changes when a file is replaced or written to."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


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


def verify_all(step_dir: Path) -> dict:
    """The check of a checkpoint training resumes from: every file's size and sha256."""
    return check_complete(step_dir, verify=True)


def find_latest(path: str | Path, log: Log, check: Callable[[Path], object] = verify_all) -> Path | None:
    """The newest complete, undamaged checkpoint under a run directory (or its checkpoints folder).

    Unfinished, torn or damaged ones are skipped, each with a line through ``log``
    naming it and why, so that falling back to an older step is never silent. ``check``
    raises CheckpointError for a step directory that cannot be used (by default: any file
    damaged; a reader of the model alone checks the files it reads).
    """
    root = checkpoint_root(Path(path))
    if root.is_dir():
        for partial in sorted(root.glob(".step-*.tmp")):
            log(f"checkpoint: ignoring unfinished {partial.name} (a save that did not complete)")
    skipped = []
    for step_dir in list_checkpoints(root):
        try:
            check(step_dir)
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


def resolve_checkpoint(path: str | Path, log: Log, check: Callable[[Path], object] = verify_all) -> Path:
    """A verified step directory from a step directory, a ``best``/``latest`` file, a checkpoints folder or a run.

    ``check``: as :func:`find_latest`'s; it is applied to the step directory chosen, once.
    """
    path = Path(path)
    if path.is_file() and path.name in POINTERS:
        name = read_pointer(path)
        if name is None:
            raise CheckpointError(f"{path}: does not name a step directory")
        if not (path.parent / name).is_dir():
            raise CheckpointError(f"{path}: names {name}, which is not in {path.parent} (deleted?)")
        path = path.parent / name
    if STEP_DIR.match(path.name):
        check(path)
        return path
    refuse_model_file(path)
    found = find_latest(path, log, check) if path.is_dir() else None
    if found is None:
        if path.is_dir() and path.suffix in (".pt", ".safetensors"):  # a model file replaced by a folder: not missing
            raise CheckpointError(f"{path}: is a directory, expected a model file; and it holds no checkpoint either")
        raise CheckpointError(f"{path}: no complete checkpoint found: expected {_WANTED}")
    return found


_WANTED = "a training checkpoint: a run directory, its checkpoints folder or a step-N directory in it"


def refuse_model_file(path: Path) -> None:
    """A model file or an export (no training state) where a training checkpoint is wanted is refused, saying what
    reads it (``train --resume`` refuses one before any process starts: commands/train.py)."""
    if (path.is_file() and path.name not in POINTERS) or (path / "megaformer-export.json").is_file():
        kind = "an export" if path.is_dir() else "a file"
        raise CheckpointError(
            f"{path}: is {kind}, not {_WANTED}; a model file or export holds no training state (translate, "
            f"evaluate and export read it, and `translate --tp N` decodes it at any TP size)"
        )


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
