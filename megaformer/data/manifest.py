"""The manifest of a prepared directory (``manifest.json``): written last by ``megaformer prepare``, read and checked.

Its schema (:func:`read_manifest`) is what a launching process checks before any rank
starts; this module imports neither torch nor webdataset (whose package imports torch),
so ``megaformer train`` refuses a missing or malformed directory without them. The shard
format it describes is :mod:`megaformer.data.shards`.
"""

from __future__ import annotations

import json
from pathlib import Path

from megaformer.errors import DataError

MANIFEST = "manifest.json"
FORMAT = "megaformer-prepared"
VERSION = 1


def write_manifest(out_dir: Path, manifest: dict) -> None:
    """Write ``manifest.json`` (via a temporary name, so a partial manifest never exists)."""
    tmp = out_dir / (MANIFEST + ".partial")
    tmp.write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(out_dir / MANIFEST)


def _require(mapping: dict, key: str, kind: type | tuple[type, ...], where: str, path: Path) -> object:
    if not isinstance(mapping, dict) or key not in mapping:
        raise DataError(f"{path}: manifest lacks '{where}{key}' (not written by megaformer prepare?)")
    if not isinstance(mapping[key], kind):
        raise DataError(f"{path}: manifest entry '{where}{key}' has the wrong type")
    return mapping[key]


def manifest_path(path: str | Path) -> Path:
    """``path`` itself if it names a file, else ``path/manifest.json``."""
    path = Path(path)
    return path if path.suffix == ".json" or path.is_file() else path / MANIFEST


def read_manifest(path: str | Path) -> dict:
    """Load and check a manifest (a prepared directory or its ``manifest.json``).

    Checks the format and version, the tokenizer entry with its special ids, and for
    each split the counts (``read == kept + rejected``) and a shard list whose sample
    counts add up. Problems are DataErrors naming the manifest.
    """
    path = manifest_path(path)
    if not path.is_file():
        folder = path.parent
        if not folder.is_dir():
            hint = f": {folder} does not exist (name the folder that `megaformer prepare --out` wrote)"
        elif any(folder.glob("*.tar")) or (folder / "spm.model").is_file():
            hint = " (an interrupted prepare leaves no manifest: run it again)"
        else:  # raw text, a run directory, ...
            hint = f": {folder} holds no prepared data (name the folder that `megaformer prepare --out` wrote)"
        raise DataError(f"{path}: no such manifest{hint}")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: not a valid manifest ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f'{path}: not a megaformer manifest (expected "format": "{FORMAT}")')
    if manifest.get("version") != VERSION:
        raise DataError(
            f"{path}: manifest version {manifest.get('version')!r}, this megaformer reads version {VERSION}"
        )
    tokenizer = _require(manifest, "tokenizer", dict, "", path)
    for key in ("file", "sha256"):
        _require(tokenizer, key, str, "tokenizer.", path)
    for key in ("vocab_size", "pad_id", "unk_id", "bos_id", "eos_id"):
        _require(tokenizer, key, int, "tokenizer.", path)
    splits = _require(manifest, "splits", dict, "", path)
    for name, split in splits.items():
        where = f"splits.{name}."
        for key in ("read", "kept", "samples"):
            _require(split, key, int, where, path)
        rejected = _require(split, "rejected", dict, where, path)
        if split["kept"] + sum(rejected.values()) != split["read"]:
            raise DataError(f"{path}: split {name}: kept + rejected != read")
        shards = _require(split, "shards", list, where, path)
        for shard in shards:
            _require(shard, "file", str, where + "shards[].", path)
            _require(shard, "samples", int, where + "shards[].", path)
        if sum(s["samples"] for s in shards) != split["samples"]:
            raise DataError(f"{path}: split {name}: shard sample counts do not add up to {split['samples']}")
        _require(_require(split, "lengths", dict, where, path), "file", str, where + "lengths.", path)
    return manifest
