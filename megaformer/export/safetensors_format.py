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
import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from megaformer.checkpoint import Consolidated
from megaformer.config import Config, from_dict, to_dict
from megaformer.errors import CheckpointError, ConfigError
from megaformer.export import ExportError
from megaformer.files import atomic_output, path_refusal, sha256_of

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
    new output is complete. A failure removes the temporary path and leaves ``out`` as it
    was; a folder that cannot be written (or a full disk) is an ExportError naming ``out``.
    """
    shown, out = out, Path(os.path.abspath(out))  # "." or "x/.." has no name to put a temporary beside
    if out.exists() and not force:
        raise ExportError(f"{shown}: already exists; choose another --out or pass --force to replace it")
    if out.exists() and out.is_dir() != directory:
        kind = "a directory" if out.is_dir() else "a file"
        raise ExportError(f"{shown}: is {kind}; this format writes {'a directory' if directory else 'a file'}")
    try:
        staged = atomic_output(out, directory=directory, replace=True)
        tmp = staged.__enter__()
    except OSError as err:
        raise ExportError(f"--out {path_refusal(err.filename or out, err, creating=True)}") from None
    try:
        with contextlib.ExitStack() as stack:
            stack.push(staged)
            yield tmp
    except OSError as err:  # the true cause (a full disk is not the only one), with the file that met it
        raise ExportError(
            f"--out {path_refusal(err.filename or shown, err, creating=True)}; nothing was replaced"
        ) from None


def write_manifest(folder: Path, kind: str, extra: dict | None = None) -> dict:
    """Write ``megaformer-export.json`` (last) with the size and sha256 of every other file in ``folder``."""
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": sha256_of(p)}
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
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: unreadable export manifest ({type(err).__name__}: {err})") from None
    files = field_of(manifest, "files", dict, path)
    for name in files:
        entry = field_of(files, name, dict, path, f"files.{name}")
        size = field_of(entry, "bytes", int, path, f"files.{name}.bytes")
        digest = field_of(entry, "sha256", str, path, f"files.{name}.sha256")
        f = folder / name
        if Path(name).name != name:
            raise CheckpointError(f"{path}: lists {name!r}, which is not a file of this folder (edited by hand?)")
        if not f.is_file():
            raise CheckpointError(f"{f}: listed in {MANIFEST} but missing")
        if f.stat().st_size != size or sha256_of(f) != digest:
            raise CheckpointError(f"{f}: content does not match the sha256 in {MANIFEST} (damaged or edited)")
    return manifest


def field_of(record: object, key: str, kind: type, source: Path, name: str | None = None) -> object:
    """``record[key]`` if ``record`` is a JSON object holding a ``kind`` there, else a CheckpointError naming
    ``source`` and the field (``name``, default ``key``): a hand-edited manifest is one line, not a KeyError."""
    name = name or key
    if not isinstance(record, dict):
        raise CheckpointError(f"{source}: expected a JSON object holding {name!r}, got {type(record).__name__}")
    if key not in record:
        raise CheckpointError(f"{source}: lacks the field {name!r} (edited, or not written by megaformer export)")
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise CheckpointError(
            f"{source}: field {name!r} is {_json_kind(value)} {value!r:.40}, expected {_json_kind(kind)} "
            f"(edited by hand?): export the model again"
        )
    return value


def _json_kind(value: object) -> str:
    """A JSON value's kind as a reader of the file says it: "an object", "a string" ..."""
    kind = value if isinstance(value, type) else type(value)
    names = {
        dict: "an object",
        list: "a list",
        str: "a string",
        int: "an integer",
        float: "a number",
        bool: "a boolean",
    }
    return names.get(kind, "null" if value is None else kind.__name__)


def config_of(record: object, source: Path, key: str = "config") -> Config:
    """The megaformer config stored under ``key``; a CheckpointError naming ``source`` and the key if it is not one."""
    values = field_of(record, key, dict, source)
    try:
        return from_dict(values)
    except ConfigError as err:
        raise CheckpointError(f"{source}: field {key!r}: {err}") from None


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
    try:
        save_file(tensors, str(path), metadata=metadata)
    except Exception as err:  # safetensors reports a full disk or an unwritable folder as its own error type
        raise OSError(" ".join(str(err).split())) from None


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
    header = {key: _header_json(metadata, key, path) for key in ("config", "meta")}
    vocab = _header_int(metadata, "vocab_size", path)
    meta = field_of(header, "meta", dict, path)
    try:
        tokenizer = base64.b64decode(metadata["tokenizer"], validate=True) if metadata.get("tokenizer") else None
    except (ValueError, TypeError):
        raise CheckpointError(f"{path}: header field 'tokenizer' is not base64 (edited by hand?)") from None
    return Consolidated(config_of(header, path), tensors, vocab, tokenizer, meta)


def _header_json(metadata: dict, key: str, path: Path) -> object:
    """A JSON field of a safetensors header (``meta`` may be absent: ``{}``)."""
    if key not in metadata and key == "meta":
        return {}
    try:
        return json.loads(metadata[key])
    except KeyError:
        raise CheckpointError(f"{path}: header lacks the field {key!r} (not written by megaformer export)") from None
    except ValueError:
        raise CheckpointError(f"{path}: header field {key!r} is not JSON (edited by hand?)") from None


def _header_int(metadata: dict, key: str, path: Path) -> int:
    text = metadata.get(key)
    if not isinstance(text, str) or not text.isdigit():
        raise CheckpointError(f"{path}: header field {key!r} is {text!r:.40}, expected a count (edited by hand?)")
    return int(text)


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
