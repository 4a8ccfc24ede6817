"""Torch files that must not be damaged or hostile: the checksum checked first, then tensors only."""

from __future__ import annotations

import zipfile
from pathlib import Path

import torch

from megaformer.errors import CheckpointError
from megaformer.files import sha256_of


def safe_torch_load(path: Path, sha256: str | None = None) -> object:
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
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a foreign or hostile file: say which, run nothing
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{path}: cannot be read as tensors only ({type(err).__name__}: {reason})") from None


def _check_zip(path: Path) -> None:
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError) as err:
        raise CheckpointError(f"{path}: not a torch file ({err})") from None
    if bad is not None:
        raise CheckpointError(f"{path}: damaged (checksum of {bad} does not match)")
