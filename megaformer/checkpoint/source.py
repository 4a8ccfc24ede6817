"""One checkpoint source: any path a user gives, its kind decided and its files verified once, then handed on.

:func:`locate` is where every reader of a model (``translate``, ``evaluate``, ``export``,
``average``) and ``reshard`` turn a path into a :class:`CheckpointSource`:

* ``step``: a training checkpoint, named by its step directory, a ``latest``/``best`` file,
  its checkpoints folder or its run directory (the newest usable step: the ones skipped are
  announced through ``log``). ``meta.json`` is read once and the files the reader needs are
  hashed once (a model reader: the model files and the tokenizer, never the optimizer files);
* ``model``: a consolidated model file (``average``, ``export --format pt``), its zip CRCs
  checked as it is read;
* ``export``: a ``.safetensors`` file or a directory holding ``megaformer-export.json``, read
  and checked by :mod:`megaformer.export` (through :func:`megaformer.decode.loading.load_model_file`).

A source remembers each file it verified with the file's stamp (device, inode, size,
mtime) at that time. It is handed on as it is: to the decoding ranks of ``translate --tp N``
(pickled), to the readers of the weights; a file found with the same stamp is not hashed
again, in this process or another, and one that changed is hashed again before it is read.
A source is a path too (``os.fspath``): the path as the user named it, a directory standing
for the step directory it resolved to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from megaformer.checkpoint.files import MODEL_KEYS, load_checked
from megaformer.checkpoint.format import (
    POINTERS,
    Log,
    check_files,
    checked_meta,
    file_stamp,
    model_names,
    optimizer_file_name,
    resolve_checkpoint,
)
from megaformer.errors import CheckpointError

EXPORT_MANIFEST = "megaformer-export.json"


@dataclass
class CheckpointSource:
    """A located checkpoint, model file or export, and what was verified of it in this process or the one that
    located it."""

    kind: str  # "step", "model" or "export"
    path: Path  # what is read: the step directory, the model file, the export
    named: Path  # what the user named; a run directory or checkpoints folder stands for its step directory
    meta: dict | None = None  # a step directory's meta.json, its keys and kinds checked
    checked: dict[str, tuple[int, ...]] = field(default_factory=dict)  # name -> stamp when its sha256 matched

    def __fspath__(self) -> str:
        return str(self.named)

    def __str__(self) -> str:
        return str(self.named)

    def file(self, name: str) -> Path:
        """The step directory's file ``name``, its sha256 matched: hashed here only if it was not verified when
        the source was located, or has changed since."""
        path = self.path / name
        try:
            unchanged = name in self.checked and file_stamp(path) == self.checked[name]
        except OSError:
            unchanged = False
        if not unchanged:
            self.checked.update(check_files(self.path, self.meta, [name], verify=True))
        return path

    def weights(self, name: str) -> dict[str, dict[str, torch.Tensor]]:
        """``{"param": ...}`` of the model file ``name``: the tensors are mapped from the file, and the Adam moments
        a model file of the earlier layout holds beside them are never touched (never read, never in memory)."""
        state = load_checked(self.file(name), mmap=True)
        if not isinstance(state, dict) or not all(isinstance(state.get(key), dict) for key in MODEL_KEYS):
            raise CheckpointError(f"{self.path / name}: holds no model weights (not written by megaformer?)")
        return {key: state[key] for key in MODEL_KEYS}

    def tensors(self, name: str) -> dict[str, dict[str, torch.Tensor]]:
        """Every tensor of the model file ``name``: the weights and the Adam moments, from its optimizer file where
        the checkpoint has one (what training and resharding read)."""
        state = load_checked(self.file(name))
        optim = optimizer_file_name(name)
        if isinstance(state, dict) and optim in self.meta["files"]:
            state = {**state, **load_checked(self.file(optim))}
        return state


def is_export(path: Path) -> bool:
    """Whether ``path`` is an export of ``megaformer export``: a .safetensors file, or a folder with its manifest."""
    return (path.is_file() and path.suffix == ".safetensors") or (path / EXPORT_MANIFEST).is_file()


class SourceCheck:
    """The check :func:`megaformer.checkpoint.format.find_latest` applies to each step directory it considers,
    remembering what it found: the files a model reader needs (``everything``: all of them) verified, as
    a :class:`CheckpointSource` per step directory that passed."""

    def __init__(self, everything: bool = False) -> None:
        self.everything = everything
        self.found: dict[Path, CheckpointSource] = {}

    def __call__(self, step_dir: Path) -> dict:
        meta = checked_meta(step_dir)
        names = list(meta["files"]) if self.everything else model_names(meta)
        stamps = check_files(step_dir, meta, names, verify=True)
        self.found[step_dir] = CheckpointSource("step", step_dir, step_dir, meta, stamps)
        return meta

    def source(self, step_dir: Path, named: Path | None = None) -> CheckpointSource:
        """The source of ``step_dir`` (which this check passed), as the user ``named`` it."""
        found = self.found[step_dir]
        return CheckpointSource("step", step_dir, named or step_dir, found.meta, found.checked)


def locate(path: str | Path, log: Log, *, everything: bool = False) -> CheckpointSource:
    """The source at ``path``: a step directory, ``latest``/``best`` file, checkpoints folder, run directory, model
    file or export. CheckpointError (one line) if it is missing, torn, damaged or of no kind megaformer reads.

    ``everything``: a training checkpoint is wanted (``reshard``): every file verified, and a model
    file or an export refused in one line, saying what reads it.
    """
    path = Path(path)
    check = SourceCheck(everything)
    if not everything:
        if is_export(path):
            return CheckpointSource("export", path, path)
        if path.is_file() and path.name not in POINTERS:
            return CheckpointSource("model", path, path)
        if not path.exists():
            raise CheckpointError(f"{path}: no such checkpoint or model file")
    step_dir = resolve_checkpoint(path, log, check)  # says each checkpoint it skipped, and why
    return check.source(step_dir, path if path.is_file() else step_dir)  # a pointer file stays as it was named
