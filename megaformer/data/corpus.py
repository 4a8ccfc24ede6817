"""Read parallel text (plain or gzip), normalise it, filter it and count every rejected pair.

A corpus is a PREFIX with one file per language: ``PREFIX.en`` / ``PREFIX.de`` (or the
same names ending in ``.gz``), one sentence a line, line *n* of one side translating
line *n* of the other. Both sides are read in step, as bytes split on ``\\n`` only, so
that a stray carriage return or Unicode line separator inside a sentence cannot shift
one side against the other.

A corpus reads its two :class:`Side` s; :class:`FileSide` is a text file. WMT's archives
(read in place) and SGML give sides of their own, read the same way
(:mod:`megaformer.data.wmt`). Every side records two checksums: its file's, and that of
its text as read (the same text gives the same one whatever held it).

Filtering happens in two stages, because two of the tests need token counts:

* text stage (:class:`TextFilter`, here): ``not_utf8``, ``empty``, ``duplicate``;
* token stage (:func:`length_reject`, applied by ``prepare`` after encoding):
  ``too_long`` and ``ratio``, measured in sentencepiece tokens - the unit the
  stream's ``max_len`` and ``max_tokens`` use.

Only training text is filtered. Valid and test text keeps every line, in order, so
that a BLEU reference keeps its line count; a line that is not UTF-8 there is an error.
Every problem that concerns a whole file (missing, empty, unreadable gzip, line counts
that differ) is a :class:`~megaformer.errors.DataError` naming the file.
"""

from __future__ import annotations

import gzip
import hashlib
import unicodedata
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from megaformer.errors import DataError
from megaformer.files import sha256_of

# Every reason a training pair can be dropped, in the order the checks run.
REJECT_REASONS: tuple[str, ...] = ("not_utf8", "empty", "duplicate", "too_long", "ratio")
# A split whose lines are not UTF-8 for over half of at least its first 100 is a file in another
# encoding (Latin-1, cp1252): rejecting its lines one by one would keep a biased remnant (those
# without an accented letter), so it is refused.
NOT_UTF8_AFTER_LINES, NOT_UTF8_SHARE = 100, 0.5

# Characters that text readers (Python's universal newlines, str.splitlines) treat as line
# breaks: replaced by a space in the raw reference copies so that those keep one sentence a line.
_LINE_BREAKS = str.maketrans({c: " " for c in "\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"})


def normalize(text: str) -> str:
    """Unicode NFKC, every run of whitespace turned into one space, no leading or trailing space."""
    return " ".join(unicodedata.normalize("NFKC", text).split())


def one_line(text: str) -> str:
    """``text`` with line-breaking characters replaced by spaces (for the raw valid/test copies)."""
    return text.translate(_LINE_BREAKS)


def find_side(prefix: str | Path, lang: str) -> Path:
    """``PREFIX.lang`` or ``PREFIX.lang.gz``, whichever exists; a DataError naming both if neither or both do.

    Both present may hold different text (a file decompressed, then edited): which one a run read would
    depend on a rule the user never sees, so neither is taken.
    """
    plain = Path(f"{prefix}.{lang}")
    found = [c for c in (plain, Path(f"{plain}.gz")) if c.is_file()]
    if len(found) == 2:
        raise DataError(f"{plain} and {plain}.gz both exist and may differ: remove or move one of them")
    if found:
        return found[0]
    given = Path(prefix)
    if given.is_file():  # a side's file where its prefix belongs: train.en.gz for train
        stem = given.name.removesuffix(".gz").rsplit(".", 1)[0]
        raise DataError(
            f"{plain}: no such file (nor {plain}.gz): {given} is a file; --train, --valid and --test take the "
            f"prefix of both sides' files ({given.parent / stem})"
        )
    raise DataError(f"{plain}: no such file (nor {plain}.gz)")


def not_text(first: bytes, path: Path) -> DataError | None:
    """Why a file whose first line (as read, up to and with its newline) is ``first`` is not UTF-8 text with
    newline line ends, or None.

    UTF-16 is caught by its byte-order mark or its NUL bytes: ASCII in UTF-16 is valid UTF-8
    with a NUL after each letter, which would train as letters and ``<unk>``. A file with
    carriage returns only (old Mac line ends) reads as one line holding the whole file.
    """
    if first.startswith((b"\xff\xfe", b"\xfe\xff")):
        return DataError(
            f"{path}: UTF-16 text (byte-order mark {first[:2].hex(' ')}), megaformer reads UTF-8: convert it, "
            "e.g. iconv -f UTF-16 -t UTF-8"
        )
    if first.startswith(b"\x1f\x8b") and path.suffix != ".gz":
        return DataError(f"{path}: gzip data in a file not named .gz: name it {path.name}.gz, or decompress it")
    if b"\x00" in first:
        return DataError(f"{path}: NUL bytes on line 1: not UTF-8 text (UTF-16 without a byte-order mark?)")
    returns = first.rstrip(b"\n").rstrip(b"\r").count(b"\r")
    if returns > 1:
        return DataError(
            f"{path}: line 1 holds {returns} carriage returns: line ends of CR alone (old Mac)? "
            "convert them to newlines, e.g. tr '\\r' '\\n'"
        )
    return None


def text_lines(raw: Iterable[bytes], name: str | Path, digest: hashlib._Hash | None = None) -> Iterator[bytes]:
    """The lines of ``raw`` (lines as read, each with its line end) without the line end, checked as text.

    A source with no line at all is a DataError, as is one that is not UTF-8 text by its
    first line (:func:`not_text`); both name ``name``. ``digest``, if given, takes every
    line as read plus ``\\n``: the checksum of the text itself, whatever its compression,
    container or line ends.
    """
    empty = True
    for line in raw:
        if empty and (problem := not_text(line, Path(name))) is not None:
            raise problem
        empty = False
        line = line.rstrip(b"\n").rstrip(b"\r")
        if digest is not None:
            digest.update(line + b"\n")
        yield line
    if empty:
        raise DataError(f"{name}: file is empty")


def read_lines(path: Path, digest: hashlib._Hash | None = None) -> Iterator[bytes]:
    """The lines of a plain or gzip file as bytes, without the line ending (:func:`text_lines`).

    A gzip file that is truncated or not gzip is a DataError naming the file.
    """
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            yield from text_lines(f, path, digest)
    except (OSError, EOFError, zlib.error) as err:
        raise DataError(f"{path}: cannot be read ({err.__class__.__name__}: {err})") from None


def _decode(line: bytes, number: int) -> str | None:
    """UTF-8 text of a line (a leading byte-order mark dropped), or None if it is not UTF-8."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text[1:] if number == 1 and text.startswith("\ufeff") else text


def utf8_error(line: bytes, path: str | Path, number: int) -> DataError:
    """The one-line error for a line that is not UTF-8: file, line, column and byte."""
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as err:
        return DataError(f"{path}:{number}: not valid UTF-8 (byte 0x{line[err.start]:02x} at column {err.start + 1})")
    return DataError(f"{path}:{number}: not valid UTF-8")


@dataclass(frozen=True)
class SourceFile:
    """One side of a corpus as read: where it is, how many lines it had, its checksums.

    ``sha256`` is that of the file as stored (an archive member's bytes for a member);
    ``text_sha256`` that of the text as read (each line, without its line end, plus
    ``\\n``): the same for the same sentences whether they came plain, gzip, from an
    archive or out of SGML.
    """

    path: str
    lang: str
    lines: int
    sha256: str
    text_sha256: str

    def to_json(self) -> dict:
        return {
            "path": self.path,
            "lang": self.lang,
            "lines": self.lines,
            "sha256": self.sha256,
            "text_sha256": self.text_sha256,
        }


class Side:
    """One side of a parallel corpus: ``name`` (how messages name it), ``lang``, and its lines.

    :meth:`lines` gives the lines as bytes without line ends, anew at each call;
    :meth:`source_file` describes what the last full read of :meth:`lines` saw.
    """

    def __init__(self, name: str | Path, lang: str) -> None:
        self.name, self.lang = name, lang

    def lines(self) -> Iterator[bytes]:
        raise NotImplementedError

    def source_file(self, lines: int) -> SourceFile:
        raise NotImplementedError


class FileSide(Side):
    """A side in a plain or gzip text file, one sentence a line."""

    def __init__(self, path: Path, lang: str) -> None:
        super().__init__(path, lang)
        self.path = path
        self._text = hashlib.sha256()

    def lines(self) -> Iterator[bytes]:
        self._text = hashlib.sha256()
        return read_lines(self.path, self._text)

    def source_file(self, lines: int) -> SourceFile:
        return SourceFile(str(self.path.resolve()), self.lang, lines, sha256_of(self.path), self._text.hexdigest())


@dataclass(frozen=True)
class Line:
    """One aligned pair as read: ``raw_*`` is the decoded text (None if not UTF-8), ``number`` 1-based."""

    number: int
    src_path: str | Path
    tgt_path: str | Path
    raw_src: bytes
    raw_tgt: bytes
    src: str | None
    tgt: str | None


class ParallelCorpus:
    """The two sides of a corpus, read in step.

    ``PREFIX`` names the files ``PREFIX.<src_lang>`` and ``PREFIX.<tgt_lang>`` (:func:`find_side`);
    ``sides`` gives the two sides instead (an archive's members, SGML: :mod:`megaformer.data.wmt`),
    ``prefix`` then being the corpus's name. Iterating yields one :class:`Line` per line;
    afterwards :attr:`files` holds the line count and checksums of both sides. Line counts
    that differ are an error naming both sides and both counts, raised when the shorter ends.
    """

    def __init__(
        self, prefix: str | Path, src_lang: str, tgt_lang: str, sides: tuple[Side, Side] | None = None
    ) -> None:
        self.prefix = str(prefix)
        if sides is None:
            sides = FileSide(find_side(prefix, src_lang), src_lang), FileSide(find_side(prefix, tgt_lang), tgt_lang)
        self.src, self.tgt = sides
        self.src_path, self.tgt_path = self.src.name, self.tgt.name
        self.files: list[SourceFile] = []

    def __iter__(self) -> Iterator[Line]:
        src_lines, tgt_lines = self.src.lines(), self.tgt.lines()
        number = 0
        for number, raw_src in enumerate(src_lines, start=1):
            raw_tgt = next(tgt_lines, None)
            if raw_tgt is None:
                self._unpaired(longer=self.src)
                self._mismatch(number - 1, number + sum(1 for _ in src_lines), longer_is_src=True)
            yield Line(
                number,
                self.src_path,
                self.tgt_path,
                raw_src,
                raw_tgt,
                _decode(raw_src, number),
                _decode(raw_tgt, number),
            )
        if next(tgt_lines, None) is not None:
            self._unpaired(longer=self.tgt)
            self._mismatch(number, number + 1 + sum(1 for _ in tgt_lines), longer_is_src=False)
        self.files = [self.src.source_file(number), self.tgt.source_file(number)]

    def _unpaired(self, longer: Side) -> None:
        """Called when ``longer`` has just read a line the other side lacks: a subclass may say more than counts."""

    def _mismatch(self, shorter: int, longer: int, *, longer_is_src: bool) -> None:
        src_n, tgt_n = (longer, shorter) if longer_is_src else (shorter, longer)
        lines = "line" if src_n == 1 else "lines"
        raise DataError(f"line counts differ: {self.src_path} has {src_n} {lines}, {self.tgt_path} has {tgt_n}")


@dataclass
class SplitCounts:
    """What happened to the lines of one split: ``read == kept + sum(rejected.values())``."""

    read: int = 0
    kept: int = 0
    rejected: Counter = field(default_factory=Counter)

    def reject(self, reason: str) -> None:
        assert reason in REJECT_REASONS, reason
        self.rejected[reason] += 1

    def to_json(self) -> dict:
        return {"read": self.read, "kept": self.kept, "rejected": {r: self.rejected.get(r, 0) for r in REJECT_REASONS}}


@dataclass(frozen=True)
class FilterSettings:
    """The training-data filters; each one can be switched off.

    ``max_len``: tokens per side (without eos), 0 = no limit. ``max_ratio``: the longer
    side may have at most this many times the tokens of the shorter, 0 = no limit.
    ``on_bad_line``: ``"reject"`` counts a non-UTF-8 training line as a reject,
    ``"error"`` stops with the file and line.
    """

    keep_empty: bool = False
    dedup: bool = True
    max_len: int = 256
    max_ratio: float = 9.0
    on_bad_line: str = "reject"

    def to_json(self) -> dict:
        return {
            "keep_empty": self.keep_empty,
            "dedup": self.dedup,
            "max_len": self.max_len,
            "max_ratio": self.max_ratio,
            "on_bad_line": self.on_bad_line,
        }


class TextFilter:
    """The text stage of training filtering: decoding, normalisation, empty sides, duplicates.

    ``accept(line)`` returns the normalised ``(src, tgt)`` or None after counting the
    reason in ``counts``. Duplicates are exact duplicates of the normalised pair; they are
    remembered as 8-byte digests, so memory is ~70 bytes per kept pair.
    """

    def __init__(self, settings: FilterSettings, counts: SplitCounts) -> None:
        self.settings = settings
        self.counts = counts
        self._seen: set[bytes] = set()

    def accept(self, line: Line) -> tuple[str, str] | None:
        self.counts.read += 1
        if line.src is None or line.tgt is None:
            if self.settings.on_bad_line == "error":
                bad_path, bad_raw = (line.src_path, line.raw_src) if line.src is None else (line.tgt_path, line.raw_tgt)
                raise utf8_error(bad_raw, bad_path, line.number)
            self.counts.reject("not_utf8")
            bad = self.counts.rejected["not_utf8"]
            if self.counts.read >= NOT_UTF8_AFTER_LINES and bad > self.counts.read * NOT_UTF8_SHARE:
                path = line.src_path if line.src is None else line.tgt_path
                raise DataError(
                    f"{path}: {bad:,} of the first {self.counts.read:,} lines are not UTF-8: the file is in another "
                    "encoding; convert it (e.g. iconv -f latin1 -t utf-8) and prepare again"
                )
            return None
        src, tgt = normalize(line.src), normalize(line.tgt)
        if not self.settings.keep_empty and (not src or not tgt):
            self.counts.reject("empty")
            return None
        if self.settings.dedup:
            digest = hashlib.blake2b(f"{src}\n{tgt}".encode(), digest_size=8).digest()
            if digest in self._seen:
                self.counts.reject("duplicate")
                return None
            self._seen.add(digest)
        return src, tgt


def length_reject(src_len: int, tgt_len: int, settings: FilterSettings) -> str | None:
    """The token-stage reason to drop a training pair (``too_long`` / ``ratio``), or None to keep it.

    A pair with an empty side (kept by ``--keep-empty``) has no ratio: measured against 1 token,
    --max-ratio dropped all but the shortest of the pairs the option was asked to keep.
    """
    if settings.max_len and max(src_len, tgt_len) > settings.max_len:
        return "too_long"
    if (
        settings.max_ratio
        and min(src_len, tgt_len)
        and max(src_len, tgt_len) > settings.max_ratio * min(src_len, tgt_len)
    ):
        return "ratio"
    return None


def reference_text(line: Line) -> tuple[str, str]:
    """The decoded (src, tgt) of a valid/test line; not UTF-8 is an error naming file and line there."""
    if line.src is None:
        raise utf8_error(line.raw_src, line.src_path, line.number)
    if line.tgt is None:
        raise utf8_error(line.raw_tgt, line.tgt_path, line.number)
    return line.src, line.tgt
