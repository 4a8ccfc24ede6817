"""Torch files that must not be damaged or hostile: the checksum checked first, then tensors only."""

from __future__ import annotations

import zipfile
from pathlib import Path

import torch

from megaformer.checkpoint.format import optimizer_file_name
from megaformer.errors import CheckpointError
from megaformer.files import atomic_torch_save, sha256_of

MODEL_KEYS = ("param",)  # what a model file holds; the Adam moments go to its optimizer file
OPTIMIZER_KEYS = ("exp_avg", "exp_avg_sq")


def safe_torch_load(path: Path, sha256: str | None = None, *, mmap: bool = False) -> object:
    """Tensors and plain containers from ``path``, never code; its checksum checked first.

    ``sha256``: the digest recorded when the file was written; without one the zip
    CRCs of the torch file are checked instead.
    """
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    if sha256 is not None:
        if sha256_of(path) != sha256:
            raise CheckpointError(f"{path}: content does not match its sha256 in meta.json (the file is damaged)")
    else:
        _check_zip(path)
    return load_checked(path, mmap=mmap)


def load_checked(path: Path, *, mmap: bool = False) -> object:
    """Tensors and plain containers from ``path``, whose checksum the caller has checked; never code.

    ``mmap``: the tensors are mapped from the file, not read: the bytes of a tensor never
    touched (the Adam moments of a model file written before they had their own file) are
    never read from the disk nor held in memory.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # a foreign or hostile file: say which, run nothing
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{path}: cannot be read as tensors only ({type(err).__name__}: {reason})") from None


def write_shard(shard: dict[str, dict[str, torch.Tensor]], path: Path) -> None:
    """A rank's engine tensors as two files: the weights at ``path`` (``model-*.pt``), the Adam moments in its
    optimizer file beside it (``optim-*.pt``), so that decoding and export read the weights alone."""
    atomic_torch_save({key: shard[key] for key in MODEL_KEYS}, path)
    moments = {key: shard[key] for key in OPTIMIZER_KEYS if key in shard}
    if moments:
        atomic_torch_save(moments, path.with_name(optimizer_file_name(path.name)))


def _check_zip(path: Path) -> None:
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError) as err:
        raise CheckpointError(f"{path}: not a torch file ({err})") from None
    if bad is not None:
        raise CheckpointError(f"{path}: damaged (checksum of {bad} does not match)")
