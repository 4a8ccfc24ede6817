"""The on-disk format of prepared data: webdataset tar shards, a lengths index, the manifest.

A prepared directory holds, per split (``train``, ``valid``, ``test``):

* ``{split}-000000.tar`` ... : webdataset shards. Sample *i* of the split has the key
  ``{i:09d}`` and two members, ``src.npy`` and ``tgt.npy``: the sentencepiece ids of
  each side without bos/eos, as ``uint16`` (``int32`` for vocabularies over 65536).
  Tar headers carry fixed names, mode and mtime, so the same input gives byte-identical
  shards.
* ``{split}.lengths.npy``: an ``(N, 2)`` int32 array of (source, target) token counts
  in sample order. The stream plans length-grouped batches from it without opening a
  shard.
* ``spm.model``: the shared sentencepiece model, and for valid/test the raw text
  (``test.en``, ``test.de``) so that evaluation scores against the untouched reference.
* ``manifest.json``: written last; what was read, kept and rejected, each shard's
  sample and token counts and sha256, the sources' line counts and sha256, the
  tokenizer's sha256 and special ids (schema: :func:`megaformer.data.manifest.read_manifest`).

This module also reads the format back: :func:`open_prepared` checks a directory (and
the tokenizer it was made with) and describes a split for the stream; :func:`read_shard`
reads one shard, turning every way a shard can be broken - missing, truncated, not a
tar, an undecodable member - into a DataError that names the shard.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import io
import math
import tarfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from webdataset.gopen import gopen
from webdataset.handlers import reraise_exception
from webdataset.shardlists import expand_urls
from webdataset.tariterators import group_by_keys, tar_file_expander
from webdataset.writer import TarWriter

from megaformer.data.manifest import manifest_path, read_manifest
from megaformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from megaformer.errors import DataError
from megaformer.files import sha256_of

SPLITS: tuple[str, ...] = ("train", "valid", "test")
SRC_MEMBER, TGT_MEMBER = "src.npy", "tgt.npy"


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:06d}.tar"


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest dtype that holds every id of the vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


class ShardWriter:
    """Write one split's samples into numbered tar shards of ``shard_size`` samples each.

    ``write`` takes the ids of one pair; ``close`` writes the lengths index and returns
    the split's shard list and totals for the manifest.
    """

    def __init__(self, out_dir: Path, split: str, shard_size: int, dtype: np.dtype) -> None:
        if shard_size < 1:
            raise DataError(f"--shard-size must be at least 1, got {shard_size}")
        self.out_dir, self.split, self.shard_size, self.dtype = out_dir, split, shard_size, dtype
        self.lengths: list[tuple[int, int]] = []
        self.shards: list[dict] = []
        self._tar: TarWriter | None = None
        self._file: io.BufferedWriter | None = None

    def write(self, src: list[int], tgt: list[int]) -> None:
        index = len(self.lengths)
        if index % self.shard_size == 0:
            self._finish_shard()
            name = shard_name(self.split, len(self.shards))
            self._file = open(self.out_dir / name, "wb")
            # Fixed owner, mode and mtime: same input, byte-identical shard.
            self._tar = TarWriter(self._file, user="megaformer", group="megaformer", mode=0o444, mtime=0, encoder=False)
            self.shards.append({"file": name, "samples": 0, "src_tokens": 0, "tgt_tokens": 0})
        assert self._tar is not None
        self._tar.write(
            {
                "__key__": f"{index:09d}",
                SRC_MEMBER: _npy_bytes(np.asarray(src, dtype=self.dtype)),
                TGT_MEMBER: _npy_bytes(np.asarray(tgt, dtype=self.dtype)),
            }
        )
        shard = self.shards[-1]
        shard["samples"] += 1
        shard["src_tokens"] += len(src)
        shard["tgt_tokens"] += len(tgt)
        self.lengths.append((len(src), len(tgt)))

    def _finish_shard(self) -> None:
        if self._tar is not None and self._file is not None:
            self._tar.close()
            self._file.close()
            self.shards[-1]["sha256"] = sha256_of(self.out_dir / self.shards[-1]["file"])
            self._tar = self._file = None

    def close(self) -> dict:
        """Finish the last shard, write ``{split}.lengths.npy``; the split's manifest entries."""
        self._finish_shard()
        lengths_name = f"{self.split}.lengths.npy"
        lengths = np.asarray(self.lengths, dtype=np.int32).reshape(-1, 2)
        np.save(self.out_dir / lengths_name, lengths, allow_pickle=False)
        return {
            "samples": len(self.lengths),
            "src_tokens": int(lengths[:, 0].sum()),
            "tgt_tokens": int(lengths[:, 1].sum()),
            "lengths": {"file": lengths_name, "sha256": sha256_of(self.out_dir / lengths_name)},
            "shards": self.shards,
        }


@functools.lru_cache(maxsize=4096)
def _npy_header(header: bytes) -> tuple[np.dtype, tuple[int, ...], int]:
    """(dtype, shape, data offset) of a version-1 npy header; cached because headers repeat."""
    length = int.from_bytes(header[8:10], "little")
    fields = ast.literal_eval(header[10 : 10 + length].decode("latin1"))
    if fields.get("fortran_order") or not isinstance(fields.get("shape"), tuple):
        raise ValueError("unsupported npy header")
    return np.dtype(fields["descr"]), fields["shape"], 10 + length


def decode_npy(data: bytes) -> np.ndarray:
    """The array in the bytes of an ``.npy`` member (a fast path for the small arrays we write).

    Anything that is not a valid array raises ValueError.
    """
    try:
        if data[:8] == b"\x93NUMPY\x01\x00" and len(data) >= 10:
            end = 10 + int.from_bytes(data[8:10], "little")
            dtype, shape, offset = _npy_header(data[:end])
            count = math.prod(shape)
            if len(data) - offset != count * dtype.itemsize:
                raise ValueError("npy payload has the wrong size")
            return np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)
        return np.load(io.BytesIO(data), allow_pickle=False)
    except (SyntaxError, TypeError, KeyError, AttributeError, OSError, EOFError) as err:
        raise ValueError(f"{err.__class__.__name__}: {err}".splitlines()[0]) from None


_SHARD_ERRORS = (tarfile.TarError, OSError, EOFError, ValueError, KeyError, zlib.error, AssertionError)


def _broken(url: str, err: BaseException) -> DataError:
    # webdataset appends " @ <stream repr>" and extra args to messages; keep the first line of the cause.
    reason = str(err.args[0]) if err.args else err.__class__.__name__
    reason = reason.split(" @ ")[0].splitlines()[0] if reason else err.__class__.__name__
    return DataError(f"{url}: truncated or corrupt shard ({err.__class__.__name__}: {reason})")


class _HashingReader:
    """A shard's byte stream that hashes what is read through it (the tar reader reads it once)."""

    def __init__(self, raw) -> None:
        self.raw, self.digest = raw, hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.digest.update(data)
        return data

    def hexdigest_of_all(self) -> str:
        """The sha256 of the whole stream: what was read, and the rest (the tar's padding, unread samples)."""
        while block := self.raw.read(1 << 20):
            self.digest.update(block)
        return self.digest.hexdigest()

    def close(self) -> None:
        self.raw.close()


def read_shard(
    url: str, *, wanted: np.ndarray | None = None, expected: int | None = None, sha256: str | None = None
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """``(position, src_ids, tgt_ids)`` for the samples of one shard, in order.

    ``url`` is anything webdataset opens (a path, ``file:``, ``pipe:cmd`` ...).
    ``wanted`` (a boolean mask over positions) limits decoding to those samples and stops
    decoding after the last one; ``expected`` is the sample count the manifest promises:
    a shard that ends early is reported as truncated instead of silently yielding less.
    ``sha256``: the manifest's checksum of the shard; the bytes are hashed as they are
    read (the rest of the shard after the last wanted sample too), and a shard whose
    bytes differ is a DataError once it has been read through.
    """
    stop = int(np.flatnonzero(wanted)[-1]) + 1 if wanted is not None and wanted.any() else None
    if wanted is not None and stop is None:
        return
    try:
        stream = gopen(url, "rb")
    except _SHARD_ERRORS as err:
        raise DataError(f"{url}: cannot open shard ({err.__class__.__name__}: {err})") from None
    if sha256 is not None:
        stream = _HashingReader(stream)
    position = 0
    try:
        files = tar_file_expander([{"url": url, "stream": stream}], handler=reraise_exception)
        for sample in group_by_keys(files, handler=reraise_exception):
            if wanted is None or (position < len(wanted) and wanted[position]):
                try:
                    src, tgt = decode_npy(sample[SRC_MEMBER]), decode_npy(sample[TGT_MEMBER])
                except KeyError as err:
                    raise DataError(f"{url}: sample {sample['__key__']} has no {err.args[0]} member") from None
                except ValueError as err:
                    raise DataError(f"{url}: sample {sample['__key__']}: not a token array ({err})") from None
                yield position, src, tgt
            position += 1
            if stop is not None and position >= stop:
                break
        else:
            if expected is not None and position != expected:
                raise DataError(
                    f"{url}: holds {position} samples, the manifest says {expected} (truncated or replaced shard)"
                )
            if stop is not None:
                raise DataError(
                    f"{url}: ends after {position} samples, sample {stop - 1} is missing (truncated shard?)"
                )
        if sha256 is not None and stream.hexdigest_of_all() != sha256:
            raise DataError(
                f"{url}: its bytes do not match the sha256 in the manifest (the shard was damaged or replaced "
                f"after prepare): prepare the data again"
            )
    except _SHARD_ERRORS as err:
        raise _broken(url, err) from None
    finally:
        try:
            stream.close()
        except OSError:
            pass  # a pipe closed early reports its command's status; the data we needed was read


# ---------------------------------------------------------------------------------------
# Opening a split for reading: a prepared directory, or shard URLs alone.


@dataclass(frozen=True)
class PreparedSplit:
    """What the stream reads for one split: shard URLs, samples per shard, lengths of every sample."""

    split: str
    urls: tuple[str, ...]
    shard_sizes: tuple[int, ...]
    lengths: np.ndarray  # (samples, 2) int: source and target tokens without eos/bos
    tokenizer_path: Path | None = None
    manifest: Path | None = None
    special_ids: tuple[int, int, int] = (PAD_ID, BOS_ID, EOS_ID)  # pad, bos, eos
    shard_sha256: tuple[str | None, ...] = ()  # the manifest's checksum of each shard (empty: none known)
    vocab_size: int | None = None  # token ids must be below it (None: not known)

    def sha256_of_shard(self, shard: int) -> str | None:
        return self.shard_sha256[shard] if shard < len(self.shard_sha256) else None

    def check_ids(self, ids: np.ndarray, where: str) -> None:
        """Refuse token ids outside ``[0, vocab_size)``: they would train silently on a wrong row, or crash."""
        if self.vocab_size is None or not len(ids):
            return
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise DataError(
                f"{where}: token id {bad} is outside the vocabulary of {self.vocab_size} pieces in "
                f"{self.manifest or 'the manifest'} (the shard was not made with this tokenizer): prepare the data again"
            )

    @property
    def offsets(self) -> np.ndarray:
        """Index of the first sample of each shard, plus the total at the end."""
        return np.concatenate([[0], np.cumsum(self.shard_sizes, dtype=np.int64)])


def shard_urls(spec: str | Sequence[str]) -> list[str]:
    """Expand a webdataset URL spec: brace patterns (``train-{000000..000127}.tar``), ``::`` lists, or a list as is."""
    return expand_urls(spec) if isinstance(spec, str) else [str(u) for u in spec]


def open_prepared(
    path: str | Path, split: str = "train", *, spm: str | Path | None = None, urls: str | Sequence[str] | None = None
) -> PreparedSplit:
    """Read and check a prepared directory (or its manifest) for ``split``.

    ``spm``: the sentencepiece model the caller will use; a manifest made with another
    model is a DataError naming both files. ``urls``: read the shards from elsewhere
    (e.g. ``pipe:curl -s https://host/train-{000000..000127}.tar``); the count must
    match the manifest, which still provides the lengths.
    """
    mpath = manifest_path(path)
    manifest = read_manifest(mpath)
    root = mpath.parent
    if split not in manifest["splits"]:
        have = ", ".join(manifest["splits"]) or "none"
        raise DataError(f"{mpath}: no split '{split}' (has: {have})")
    entry = manifest["splits"][split]
    tok = manifest["tokenizer"]
    own_model = root / tok["file"]
    if not own_model.is_file():
        raise DataError(f"{own_model}: tokenizer named by {mpath} is missing")
    if spm is not None and Path(spm).resolve() != own_model.resolve():
        if not Path(spm).is_file():
            raise DataError(f"{spm}: no such sentencepiece model")
        given = sha256_of(spm)
        if given != tok["sha256"]:
            raise DataError(
                f"{mpath} was made with tokenizer {own_model} (sha256 {tok['sha256'][:12]}), not with {spm} "
                f"(sha256 {given[:12]}): use the model in that directory, or prepare the data again with --spm {spm}"
            )
    elif sha256_of(own_model) != tok["sha256"]:
        raise DataError(
            f"{own_model} is not the tokenizer {mpath} was made with (sha256 differs): prepare the data again"
        )
    shards = entry["shards"]
    found = [str(root / s["file"]) for s in shards] if urls is None else shard_urls(urls)
    if len(found) != len(shards):
        raise DataError(f"{mpath}: split {split} has {len(shards)} shards, {len(found)} URLs were given")
    lengths = _read_lengths(root / entry["lengths"]["file"], entry, mpath)
    ids = (tok["pad_id"], tok["bos_id"], tok["eos_id"])
    checksums = tuple(s.get("sha256") if isinstance(s.get("sha256"), str) else None for s in shards)
    return PreparedSplit(
        split, tuple(found), tuple(s["samples"] for s in shards), lengths, own_model, mpath, ids,
        checksums, tok["vocab_size"],
    )  # fmt: skip


def _read_lengths(path: Path, entry: dict, mpath: Path) -> np.ndarray:
    """A split's lengths index, checked against the manifest: its sha256, shape, and token totals.

    The stream plans every batch from this file alone, so a replaced index would make
    batches of the wrong size without any other sign: it is checked every time it is read.
    """
    expected = entry["lengths"].get("sha256")
    try:
        if isinstance(expected, str) and sha256_of(path) != expected:
            raise DataError(
                f"{path}: its bytes do not match the sha256 in {mpath} (the lengths index was damaged or "
                f"replaced after prepare): prepare the data again"
            )
        lengths = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: cannot read the lengths index ({err})") from None
    if lengths.ndim != 2 or lengths.shape != (entry["samples"], 2) or lengths.dtype.kind not in "iu":
        raise DataError(f"{path}: expected ({entry['samples']}, 2) integer lengths, found {lengths.shape}")
    lengths = lengths.astype(np.int64)
    totals = [entry.get(key) for key in ("src_tokens", "tgt_tokens")]
    if (lengths < 0).any() or any(
        isinstance(t, int) and t != int(lengths[:, side].sum()) for side, t in enumerate(totals)
    ):
        raise DataError(f"{path}: the lengths do not add up to the token counts in {mpath}: prepare the data again")
    return lengths


def verify_split(data: PreparedSplit) -> None:
    """Read every shard of a split through: its sha256, sample count, token ids and lengths against the index."""
    for shard, url in enumerate(data.urls):
        offset = int(data.offsets[shard])
        for position, src, tgt in read_shard(
            url, expected=data.shard_sizes[shard], sha256=data.sha256_of_shard(shard) or ""
        ):
            data.check_ids(src, f"{url} (source side)")
            data.check_ids(tgt, f"{url} (target side)")
            if (len(src), len(tgt)) != tuple(data.lengths[offset + position]):
                raise DataError(
                    f"{url}: sample {position} has {len(src)}+{len(tgt)} tokens, the lengths index of {data.manifest} "
                    f"says {tuple(int(n) for n in data.lengths[offset + position])}: prepare the data again"
                )


def scan_shards(spec: str | Sequence[str], split: str = "train") -> PreparedSplit:
    """Describe shards that come without a manifest by reading each of them once (slow for big data)."""
    urls = shard_urls(spec)
    if not urls:
        raise DataError(f"{spec!r}: no shard URLs")
    sizes, lengths = [], []
    for url in urls:
        count = 0
        for _, src, tgt in read_shard(url):
            lengths.append((len(src), len(tgt)))
            count += 1
        sizes.append(count)
    return PreparedSplit(split, tuple(urls), tuple(sizes), np.asarray(lengths, dtype=np.int64).reshape(-1, 2))
