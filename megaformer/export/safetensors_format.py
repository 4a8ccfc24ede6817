"""The consolidated model as safetensors: no pickle, a checksum on every byte.

Two forms, both read by :func:`load_safetensors_export` (and so by ``translate --ckpt``):

* a single file ``NAME.safetensors``: the TP=1 parameters under megaformer's names; the
  header's metadata holds the config (JSON), the real vocabulary size, the sentencepiece
  model (base64), the source checkpoint's step, and the sha256 of the tensor bytes
  (names and raw bytes in name order), recomputed on every read;
* a directory: that file as ``model.safetensors``, ``tokenizer.model`` and
  ``config.json`` beside it (readable without megaformer), and ``megaformer-export.json``
  written last with the sha256 and size of every other file, verified on every read.

Outputs are staged (:func:`staged_output`): written under a hidden temporary name in
the destination's folder and renamed into place only when complete, so a failed export
leaves nothing that looks finished, and an existing output is replaced only on request.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from megaformer.config import from_dict, to_dict
from megaformer.data.corpus import file_sha256
from megaformer.errors import CheckpointError
from megaformer.export import ExportError
from megaformer.train.checkpoint import Consolidated

FORMAT = "megaformer-safetensors-v1"
MANIFEST = "megaformer-export.json"
WEIGHTS = "model.safetensors"


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and raw bytes, in name order (independent of the file layout)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


@contextmanager
def staged_output(out: Path, force: bool, *, directory: bool) -> Iterator[Path]:
    """A temporary path beside ``out`` that becomes ``out`` when the block ends without an error.

    An existing ``out`` is an ExportError unless ``force``; it is replaced only once the
    new output is complete. A failure removes the temporary path and leaves ``out`` as it was.
    """
    if out.exists() and not force:
        raise ExportError(f"{out}: already exists; choose another --out or pass --force to replace it")
    if out.exists() and out.is_dir() != directory:
        kind = "a directory" if out.is_dir() else "a file"
        raise ExportError(f"{out}: is {kind}; this format writes {'a directory' if directory else 'a file'}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    _remove(tmp)
    if directory:
        tmp.mkdir()
    try:
        yield tmp
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        _remove(old)
    finally:
        _remove(tmp)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def write_manifest(folder: Path, kind: str, extra: dict | None = None) -> dict:
    """Write ``megaformer-export.json`` (last) with the size and sha256 of every other file in ``folder``."""
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    manifest = {"format": kind, **(extra or {}), "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_manifest(folder: Path) -> dict:
    """The manifest of an export directory after checking every file it lists (size, then sha256)."""
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path}: unreadable export manifest ({type(err).__name__}: {err})") from None
    for name, info in files.items():
        f = folder / name
        if not f.is_file():
            raise CheckpointError(f"{f}: listed in {MANIFEST} but missing")
        if f.stat().st_size != info["bytes"] or file_sha256(f) != info["sha256"]:
            raise CheckpointError(f"{f}: content does not match the sha256 in {MANIFEST} (damaged or edited)")
    return manifest


def save_safetensors_file(path: Path, model: Consolidated) -> None:
    """Write ``model`` as one self-contained safetensors file (see the module docstring)."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().cpu().float().contiguous().clone() for k, v in model.model.items()}
    metadata = {
        "format": FORMAT,
        "config": json.dumps(to_dict(model.config)),
        "vocab_size": str(model.vocab_size),
        "meta": json.dumps(model.meta),
        "tensors_sha256": tensors_sha256(tensors),
    }
    if model.tokenizer:
        metadata["tokenizer"] = base64.b64encode(model.tokenizer).decode("ascii")
    save_file(tensors, str(path), metadata=metadata)


def load_safetensors_file(path: Path) -> Consolidated:
    """Read a file written by :func:`save_safetensors_file`, verifying its tensor checksum."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as err:  # safetensors raises its own error types for a torn or foreign file
        raise CheckpointError(f"{path}: cannot be read as safetensors ({type(err).__name__}: {err})") from None
    if metadata.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: not a megaformer safetensors export (metadata format {metadata.get('format')!r})"
        )
    if tensors_sha256(tensors) != metadata.get("tensors_sha256"):
        raise CheckpointError(f"{path}: tensor bytes do not match the sha256 in its header (damaged or edited)")
    tokenizer = metadata.get("tokenizer")
    return Consolidated(
        from_dict(json.loads(metadata["config"])),
        tensors,
        int(metadata["vocab_size"]),
        base64.b64decode(tokenizer) if tokenizer else None,
        json.loads(metadata.get("meta", "{}")),
    )


def write_safetensors_dir(folder: Path, model: Consolidated) -> None:
    """``model.safetensors`` + ``tokenizer.model`` + ``config.json``, then the manifest."""
    save_safetensors_file(folder / WEIGHTS, model)
    if model.tokenizer:
        (folder / "tokenizer.model").write_bytes(model.tokenizer)
    config = {"config": to_dict(model.config), "vocab_size": model.vocab_size, "meta": model.meta}
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    write_manifest(folder, FORMAT, {"step": model.meta.get("step")})


def load_safetensors_export(path: Path) -> Consolidated:
    """A consolidated model from a safetensors file or export directory, checksums verified."""
    if path.is_dir():
        read_manifest(path)
        return load_safetensors_file(path / WEIGHTS)
    return load_safetensors_file(path)
