"""Files that must not be torn, damaged or hostile: atomic writes, checksums, tensor-only reads.

Every megaformer reader of a torch file goes through :func:`safe_torch_load`, which
checks the file's sha256 (recorded when it was written) or its zip CRCs, then
unpickles nothing but tensors and plain containers (``weights_only=True``). A
*consolidated* model file (:class:`Consolidated`) holds one TP-independent model: every
parameter at its TP=1 shape, the config, the real vocabulary size and the
sentencepiece model's bytes, so that one file is enough to translate at any TP size.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megaformer.config import Config, from_dict, to_dict
from megaformer.errors import CheckpointError

CONSOLIDATED_FORMAT = "megaformer-consolidated-v1"


@dataclass
class Consolidated:
    """One TP-independent model: config, full parameters, tokenizer."""

    config: Config
    model: dict[str, torch.Tensor]  # names of Transformer.named_parameters(), TP=1 shapes
    vocab_size: int
    tokenizer: bytes | None = None  # serialized sentencepiece model
    meta: dict = field(default_factory=dict)  # step, tokens seen, source checkpoints ...


# ---- files -------------------------------------------------------------------------------------


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


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


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
