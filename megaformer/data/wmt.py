"""Parallel text as WMT distributes it: SGML pairs and tar archives, read in place (:func:`open_corpora`).

What ``--train``, ``--valid`` and ``--test`` of ``megaformer prepare`` take, besides a text
PREFIX (:class:`~megaformer.data.corpus.ParallelCorpus`):

* an SGML pair PREFIX: ``PREFIX-src.<src>.sgm`` with ``PREFIX-ref.<tgt>.sgm`` (newstest's
  form), read when no ``PREFIX.<src>`` text file exists. Each ``<seg id="N">text</seg>``
  is one line, in document order, with its entities decoded (``html.unescape``). The
  ids of each ``<doc>`` run 1..n, and the two files hold the same documents and ids in
  the same order; a broken segment (not closed on its line, no id, text outside any
  segment) is an error naming the file and line.
* ``ARCHIVE[:NAME]``: a ``.tgz`` / ``.tar.gz`` / ``.tar`` read without extracting it.
  Its pairs for the languages are the text members ``*.<a>-<b>.<src>`` with
  ``*.<a>-<b>.<tgt>`` ({a, b} = {src, tgt}, in either order: WMT names en-de ``de-en``)
  and the SGML pairs as above; with NAME, only those whose member path holds NAME.

An archive is read once through to list its members (which also checks that all of it
reads: a truncated download is refused before anything is written), then once per
side: each side is a forward stream of its own, so the two sides are read in step
without seeking in a compressed stream and without holding a side in memory. Members
are named ``ARCHIVE:MEMBER`` in messages and in the manifest.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import html
import lzma
import re
import tarfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from megaformer.data.corpus import Line, ParallelCorpus, Side, SourceFile, text_lines, utf8_error
from megaformer.errors import DataError

ARCHIVE_SUFFIXES = (".tgz", ".tar.gz", ".tar", ".tbz2", ".tar.bz2", ".txz", ".tar.xz")
_READ_SIZE = 1 << 20
_TEXT_MEMBER = re.compile(r"(?P<stem>.*\.(?P<a>[^./-]+)-(?P<b>[^./-]+))\.(?P<lang>[^./-]+)")
_SGML_SRC = re.compile(r"(?P<stem>.*)-src\.(?P<lang>[^./-]+)\.sgm")
_SGML_REF = re.compile(r"(?P<stem>.*)-ref\.(?P<lang>[^./-]+)\.sgm")
_SEG = re.compile(r"<seg\b([^>]*)>(.*?)</seg\s*>", re.IGNORECASE)
_TAG = re.compile(r"<[^<>]*>")
_ID = re.compile(r"""\bid\s*=\s*["']?([^"'\s>]*)""", re.IGNORECASE)
_DOCID = re.compile(r"""\bdocid\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s>]+))""", re.IGNORECASE)


def split_archive(spec: str) -> tuple[Path, str | None] | None:
    """``(ARCHIVE, NAME)`` for ``ARCHIVE`` or ``ARCHIVE:NAME`` (NAME None when not given); None for a PREFIX."""
    if spec.endswith(ARCHIVE_SUFFIXES):
        return Path(spec), None
    for at in (i for i, c in enumerate(spec) if c == ":"):
        if spec[:at].endswith(ARCHIVE_SUFFIXES):
            return Path(spec[:at]), spec[at + 1 :]
    return None


def input_path(spec: str) -> str:
    """The file or prefix a ``--train``/``--valid``/``--test`` value reads (an archive without its ``:NAME``)."""
    archive = split_archive(spec)
    return spec if archive is None else str(archive[0])


def open_corpora(spec: str, src: str, tgt: str, option: str, several: bool) -> list[ParallelCorpus]:
    """The corpora ``option`` ``spec`` names, in the order they are read; checked as far as it can be without
    reading them through (files there, an archive whole, its pairs found). ``several``: an archive may give
    more than one pair (``--train``); else more than one is an error asking for ``:NAME``."""
    archive = split_archive(spec)
    if archive is not None:
        return _archive_corpora(archive[0], archive[1], src, tgt, option, several)
    has_text = any(Path(f"{spec}.{src}{gz}").is_file() for gz in ("", ".gz"))
    sgml = Path(f"{spec}-src.{src}.sgm"), Path(f"{spec}-ref.{tgt}.sgm")
    if not has_text and any(p.is_file() for p in sgml):
        missing = next((p for p in sgml if not p.is_file()), None)
        if missing is not None:
            raise DataError(
                f"{missing}: no such file, and WMT's SGML pair {spec} is {sgml[0].name} with {sgml[1].name}"
            )
        sides = (SgmlSide(sgml[0], src, _file_lines(sgml[0])), SgmlSide(sgml[1], tgt, _file_lines(sgml[1])))
        return [SgmlCorpus(spec, src, tgt, sides)]
    return [ParallelCorpus(spec, src, tgt)]


# ---- sides read as forward streams ----------------------------------------------------------------


class StreamSide(Side):
    """A side read from a forward stream of raw lines (with their line ends), checksummed as it is read.

    ``raw`` opens the stream anew at each call; ``stored`` is how the manifest names it.
    """

    def __init__(self, name: str | Path, lang: str, raw: Callable[[], Iterator[bytes]], stored: str = "") -> None:
        super().__init__(name, lang)
        self.raw, self.stored = raw, stored or str(Path(name).resolve())
        self._file, self._text = hashlib.sha256(), hashlib.sha256()

    def lines(self) -> Iterator[bytes]:
        self._file, self._text = hashlib.sha256(), hashlib.sha256()
        return self._read(self._hashed(self.raw()))

    def _hashed(self, raw: Iterable[bytes]) -> Iterator[bytes]:
        for line in raw:
            self._file.update(line)
            yield line

    def _read(self, raw: Iterator[bytes]) -> Iterator[bytes]:
        return text_lines(raw, self.name, self._text)

    def source_file(self, lines: int) -> SourceFile:
        return SourceFile(self.stored, self.lang, lines, self._file.hexdigest(), self._text.hexdigest())


class SgmlSide(StreamSide):
    """A side in WMT's SGML: one line per ``<seg>``; :attr:`key` is (document, segment id, file line) of the
    segment read last."""

    key: tuple[str, int, int] = ("", 0, 0)

    def _read(self, raw: Iterator[bytes]) -> Iterator[bytes]:
        for key, text in SgmlReader(self.name).segments(raw):
            self.key = key
            line = text.encode("utf-8")
            self._text.update(line + b"\n")
            yield line


class SgmlCorpus(ParallelCorpus):
    """A source SGML file and its reference, read in step: the same documents and segment ids, in the same order."""

    src: SgmlSide
    tgt: SgmlSide

    def __iter__(self) -> Iterator[Line]:
        for line in super().__iter__():
            (src_doc, src_id, src_at), (tgt_doc, tgt_id, tgt_at) = self.src.key, self.tgt.key
            if (src_doc, src_id) != (tgt_doc, tgt_id):
                raise DataError(
                    f"{self.tgt.name}:{tgt_at}: document {tgt_doc} segment {tgt_id} where {self.src.name}:{src_at} "
                    f"has document {src_doc} segment {src_id}: the two must hold the same documents and segments "
                    "in the same order"
                )
            yield line

    def _unpaired(self, longer: Side) -> None:
        shorter = self.tgt if longer is self.src else self.src
        doc, seg, at = longer.key if isinstance(longer, SgmlSide) else ("", 0, 0)
        raise DataError(
            f"{longer.name}:{at}: document {doc} segment {seg} has no counterpart: {shorter.name} ends before it "
            "(the two must hold the same documents and segments)"
        )


class SgmlReader:
    """The segments of one SGML file, checked line by line (:meth:`segments`)."""

    def __init__(self, name: str | Path) -> None:
        self.name = name
        self.doc: str | None = None
        self.due = 1  # the id the next segment of this document must have

    def segments(self, raw: Iterable[bytes]) -> Iterator[tuple[tuple[str, int, int], str]]:
        """((document, id, line number), text) of every segment, in file order."""
        found = False
        for number, data in enumerate(raw, start=1):
            try:
                line = data.decode("utf-8")
            except UnicodeDecodeError:
                raise utf8_error(data.rstrip(b"\r\n"), self.name, number) from None
            if number == 1:
                line = line.removeprefix("\ufeff")
            end = 0
            for seg in _SEG.finditer(line):
                self._markup(line[end : seg.start()], number)
                end = seg.end()
                found = True
                text = html.unescape(seg.group(2)).replace("\n", " ")  # &#10; must not split a line
                yield self._segment(seg.group(1), number), text.strip()
            self._markup(line[end:], number)
        if self.doc is not None:
            raise DataError(f"{self.name}: document {self.doc} is not closed (no </doc>): is the file truncated?")
        if not found:
            raise DataError(f"{self.name}: no <seg> in the file: not WMT's SGML")

    def _segment(self, attributes: str, number: int) -> tuple[str, int, int]:
        where = f"{self.name}:{number}"
        given = _ID.search(attributes)
        if given is None:
            raise DataError(f"{where}: a <seg> without an id")
        if not given.group(1).isdigit():
            raise DataError(f"{where}: <seg id={given.group(1)!r}>: a segment id is a number")
        if self.doc is None:
            raise DataError(f"{where}: segment {given.group(1)} outside any <doc>")
        seg = int(given.group(1))
        if seg != self.due:
            raise DataError(
                f"{where}: document {self.doc}: segment id {seg} where {self.due} was due "
                "(the segments of each document are numbered 1, 2, 3, ...)"
            )
        self.due += 1
        return self.doc, seg, number

    def _markup(self, text: str, number: int) -> None:
        """What lies between segments: tags only (``<doc>`` opens a document, ``</doc>`` closes it), or spaces."""
        where = f"{self.name}:{number}"
        for tag in _TAG.findall(text):
            name = tag[1:].split(None, 1)[0].rstrip(">").lower() if len(tag) > 2 else ""
            if name == "seg":
                raise DataError(f"{where}: a <seg> not closed on its line (no </seg>)")
            if name == "/seg":
                raise DataError(f"{where}: a </seg> without its <seg>")
            if name == "doc":
                self._open_document(tag, where)
            elif name == "/doc":
                if self.doc is None:
                    raise DataError(f"{where}: a </doc> without its <doc>")
                self.doc = None
        outside = _TAG.sub("", text).strip()
        if outside:
            shown = outside if len(outside) <= 40 else outside[:37] + "..."
            raise DataError(f"{where}: text outside any <seg>: {shown!r}")

    def _open_document(self, tag: str, where: str) -> None:
        if self.doc is not None:
            raise DataError(f"{where}: a <doc> inside document {self.doc} (no </doc> before it)")
        docid = _DOCID.search(tag)
        if docid is None:
            raise DataError(f"{where}: a <doc> without a docid")
        self.doc, self.due = next(g for g in docid.groups() if g is not None), 1


# ---- archives ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemberPair:
    """Two members of an archive that translate each other; ``stem`` names the pair."""

    stem: str
    src: str
    tgt: str
    sgml: bool

    def describe(self) -> str:
        return f"{self.src} + {self.tgt}"


@contextmanager
def _reading(archive: Path) -> Iterator[None]:
    """Whatever goes wrong reading ``archive`` as a tar archive, said in one line naming it."""
    try:
        yield
    except (tarfile.TarError, OSError, EOFError, zlib.error, lzma.LZMAError) as err:
        raise DataError(
            f"{archive}: cannot be read as a tar archive ({err.__class__.__name__}: {err}): "
            "truncated or damaged? download it again"
        ) from None


@contextmanager
def _tar_stream(archive: Path) -> Iterator[tuple[tarfile.TarFile, BinaryIO]]:
    """``archive`` as a forward-only tar stream (gzip, bzip2, xz or none, told by its first bytes)."""
    with open(archive, "rb") as raw:
        magic = raw.read(6)
        raw.seek(0)
        data: BinaryIO = raw
        if magic.startswith(b"\x1f\x8b"):
            data = gzip.GzipFile(fileobj=raw)  # checks its CRC at the end, which tarfile's own stream does not
        elif magic.startswith(b"BZh"):
            data = bz2.BZ2File(raw)
        elif magic.startswith(b"\xfd7zXZ\x00"):
            data = lzma.LZMAFile(raw)
        with data, tarfile.open(fileobj=data, mode="r|", bufsize=_READ_SIZE) as tar:
            yield tar, data


def archive_members(archive: Path) -> list[str]:
    """The names of the files in ``archive``, read through to its end (a truncated archive is an error)."""
    with _reading(archive), _tar_stream(archive) as (tar, data):
        names = [info.name for info in tar if info.isfile()]
        while data.read(_READ_SIZE):  # the compressed stream's end and checksum
            pass
    return names


def _member_lines(archive: Path, member: str) -> Callable[[], Iterator[bytes]]:
    def lines() -> Iterator[bytes]:
        with _reading(archive), _tar_stream(archive) as (tar, _):
            for info in tar:
                if info.name == member:
                    yield from tar.extractfile(info) or ()
                    return
        raise DataError(f"{archive}: no member {member} any more (did the archive change while it was read?)")

    return lines


def _file_lines(path: Path) -> Callable[[], Iterator[bytes]]:
    def lines() -> Iterator[bytes]:
        try:
            with open(path, "rb") as f:
                yield from f
        except OSError as err:
            raise DataError(f"{path}: cannot be read ({err.__class__.__name__}: {err})") from None

    return lines


def member_pairs(members: list[str], src: str, tgt: str) -> tuple[list[MemberPair], list[MemberPair]]:
    """(the pairs of ``members`` for src -> tgt, in member-name order; the pairs they hold for other languages)."""
    names, ours, others = set(members), [], []
    stems = sorted({(m["stem"], m["a"], m["b"]) for m in map(_TEXT_MEMBER.fullmatch, members) if m})
    for stem, a, b in stems:
        if f"{stem}.{a}" in names and f"{stem}.{b}" in names:
            if {a, b} == {src, tgt}:
                ours.append(MemberPair(stem, f"{stem}.{src}", f"{stem}.{tgt}", sgml=False))
            else:
                others.append(MemberPair(stem, f"{stem}.{a}", f"{stem}.{b}", sgml=False))
    refs = [m for m in map(_SGML_REF.fullmatch, sorted(members)) if m]
    for given in map(_SGML_SRC.fullmatch, sorted(members)):
        for ref in (r for r in refs if given and r["stem"] == given["stem"] and r["lang"] != given["lang"]):
            pair = MemberPair(given["stem"], given.string, ref.string, sgml=True)
            (ours if (given["lang"], ref["lang"]) == (src, tgt) else others).append(pair)
    return sorted(ours, key=lambda p: p.src), sorted(others, key=lambda p: p.src)


def _archive_corpora(
    archive: Path, name: str | None, src: str, tgt: str, option: str, several: bool
) -> list[ParallelCorpus]:
    if not archive.is_file():
        raise DataError(f"{archive}: no such file" + (" (a directory)" if archive.is_dir() else ""))
    if name == "":
        raise DataError(f"{option} {archive}: nothing after the ':': give the NAME the member paths must hold")
    pairs, others = member_pairs(archive_members(archive), src, tgt)
    if not pairs:
        held = "; ".join(p.describe() for p in others) or "no parallel text in these forms"
        raise DataError(
            f"{archive}: no {src}-{tgt} pair (*.{src}-{tgt}.{src} with *.{src}-{tgt}.{tgt}, the pair named either "
            f"way round, or *-src.{src}.sgm with *-ref.{tgt}.sgm); it holds {held}"
        )
    chosen = [p for p in pairs if name is None or name in p.src or name in p.tgt]
    if not chosen:
        raise DataError(
            f"{archive}:{name}: no {src}-{tgt} pair of {archive} has {name!r} in its member paths; its pairs: "
            + "; ".join(p.describe() for p in pairs)
        )
    if len(chosen) > 1 and not several:
        raise DataError(
            f"{option} {archive}{'' if name is None else ':' + name}: {len(chosen)} {src}-{tgt} pairs "
            f"({'; '.join(p.describe() for p in chosen)}): add :NAME to take one, "
            f"e.g. {option} {archive}:{chosen[0].stem.rsplit('/', 1)[-1]}"
        )
    return [_member_corpus(archive, pair, src, tgt) for pair in chosen]


def _member_corpus(archive: Path, pair: MemberPair, src: str, tgt: str) -> ParallelCorpus:
    kind = SgmlSide if pair.sgml else StreamSide
    sides = tuple(
        kind(f"{archive}:{member}", lang, _member_lines(archive, member), f"{archive.resolve()}:{member}")
        for member, lang in ((pair.src, src), (pair.tgt, tgt))
    )
    return (SgmlCorpus if pair.sgml else ParallelCorpus)(f"{archive}:{pair.stem}", src, tgt, sides)
