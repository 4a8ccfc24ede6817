"""Reading, normalising and filtering parallel text (megaformer.data.corpus)."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from megaformer.data.corpus import (
    FilterSettings,
    ParallelCorpus,
    SplitCounts,
    TextFilter,
    find_side,
    length_reject,
    normalize,
    one_line,
    reference_text,
)
from megaformer.errors import DataError


def write(path: Path, data: bytes) -> Path:
    if path.suffix == ".gz":
        data = gzip.compress(data, mtime=0)
    path.write_bytes(data)
    return path


def test_normalize_nfkc_and_whitespace() -> None:
    assert normalize("  ﬁne\u00a0\tday\u2028 ok  ") == "fine day ok"
    assert normalize("Ｆｕｌｌ") == "Full"
    assert normalize(" \t ") == ""


def test_one_line_removes_line_breaking_characters() -> None:
    assert one_line("a\rb\u2028c\x0bd") == "a b c d"


def test_find_side_takes_plain_or_gz_and_refuses_both(tmp_path: Path) -> None:
    write(tmp_path / "c.en.gz", b"x\n")
    assert find_side(tmp_path / "c", "en").name == "c.en.gz"
    write(tmp_path / "c.en", b"y\n")
    with pytest.raises(DataError, match=r"c\.en and .*c\.en\.gz both exist and may differ: remove or move one of them"):
        find_side(tmp_path / "c", "en")
    (tmp_path / "c.en.gz").unlink()
    assert find_side(tmp_path / "c", "en").name == "c.en"
    with pytest.raises(DataError, match=r"c\.de: no such file \(nor .*c\.de\.gz\)"):
        find_side(tmp_path / "c", "de")
    # a side's file given where the prefix belongs (--train train.en.gz): the message names the prefix
    write(tmp_path / "c.en.gz", b"x\n")
    with pytest.raises(DataError, match=r"c\.en\.gz is a file; --train, --valid and --test take the prefix .*/c\)"):
        find_side(tmp_path / "c.en.gz", "en")


def test_reads_both_sides_in_step_plain_and_gzip(tmp_path: Path) -> None:
    write(tmp_path / "c.en", "\ufeffone\r\ntwo\u2028x\n".encode())
    write(tmp_path / "c.de.gz", b"eins\nzwei\n")
    corpus = ParallelCorpus(tmp_path / "c", "en", "de")
    lines = list(corpus)
    assert [(line.number, line.src, line.tgt) for line in lines] == [(1, "one", "eins"), (2, "two\u2028x", "zwei")]
    assert [(f.lang, f.lines) for f in corpus.files] == [("en", 2), ("de", 2)]
    assert all(len(f.sha256) == 64 for f in corpus.files)


@pytest.mark.parametrize(
    "src, tgt, message",
    [
        (b"a\nb\nc\n", b"a\nb\n", r"line counts differ: .*c\.en has 3 lines, .*c\.de has 2"),
        (b"a\n", b"a\nb\nc\n", r"line counts differ: .*c\.en has 1 line, .*c\.de has 3"),
        (b"", b"a\n", r"c\.en: file is empty"),
        (b"a\n", b"", r"c\.de: file is empty"),
    ],
)
def test_whole_file_problems_name_the_file(tmp_path: Path, src: bytes, tgt: bytes, message: str) -> None:
    write(tmp_path / "c.en", src)
    write(tmp_path / "c.de", tgt)
    with pytest.raises(DataError, match=message):
        list(ParallelCorpus(tmp_path / "c", "en", "de"))


GOOD = "A man with a dog.\nZwei Männer.\n"


@pytest.mark.parametrize(
    "name, data, message",
    [
        ("c.de", b"\xff\xfe" + GOOD.encode("utf-16-le"), r"c\.de: UTF-16 text \(byte-order mark ff fe\)"),
        ("c.de", b"\xfe\xff" + GOOD.encode("utf-16-be"), r"c\.de: UTF-16 text \(byte-order mark fe ff\)"),
        ("c.de", GOOD.encode("utf-16-le"), r"c\.de: NUL bytes on line 1"),
        ("c.de", gzip.compress(GOOD.encode()), r"c\.de: gzip data in a file not named \.gz: name it c\.de\.gz"),
        ("c.de", (GOOD * 2).replace("\n", "\r").encode(), r"c\.de: line 1 holds 3 carriage returns"),
    ],
    ids=["utf16le-bom", "utf16be-bom", "utf16le-no-bom", "gzip-unnamed", "cr-only"],
)
def test_a_file_that_is_not_utf8_text_with_newlines_is_refused_by_its_first_line(tmp_path, name, data, message):
    """UTF-16 ASCII is valid UTF-8 with NULs: it was kept and trained as letters and <unk>; a CR-only file was one line."""
    write(tmp_path / "c.en", b"A man with a dog.\r\nTwo men.\r\n")  # CRLF is text: read as two lines
    write(tmp_path / name, data)
    with pytest.raises(DataError, match=message):
        list(ParallelCorpus(tmp_path / "c", "en", "de"))


def test_a_file_mostly_not_utf8_is_refused_and_a_few_bad_lines_are_counted(tmp_path: Path) -> None:
    """A Latin-1 file lost its lines with an umlaut one by one: a biased remnant trained, exit 0."""
    write(tmp_path / "c.en", b"".join(b"a man %d\n" % i for i in range(300)))
    write(tmp_path / "c.de", b"".join(b"ein M\xe4nner %d\n" % i for i in range(300)))  # Latin-1
    counts = SplitCounts()
    text = TextFilter(FilterSettings(), counts)
    with pytest.raises(DataError, match=r"c\.de: 100 of the first 100 lines are not UTF-8: .*iconv"):
        for line in ParallelCorpus(tmp_path / "c", "en", "de"):
            text.accept(line)
    lines = [b"ein Mann %d\n" % i if i % 50 else b"ein M\xe4nner %d\n" % i for i in range(300)]
    write(tmp_path / "c.de", b"".join(lines))
    counts = SplitCounts()
    text = TextFilter(FilterSettings(), counts)
    kept = [pair for line in ParallelCorpus(tmp_path / "c", "en", "de") if (pair := text.accept(line))]
    assert len(kept) == 294 and counts.rejected["not_utf8"] == 6


def test_broken_gzip_names_the_file(tmp_path: Path) -> None:
    write(tmp_path / "c.en", b"a\n")
    (tmp_path / "c.de.gz").write_bytes(gzip.compress(b"a\n" * 1000)[:-20])
    with pytest.raises(DataError, match=r"c\.de\.gz: cannot be read"):
        list(ParallelCorpus(tmp_path / "c", "en", "de"))


def test_text_filter_counts_every_reason(tmp_path: Path) -> None:
    write(tmp_path / "c.en", b"a b\n\xff bad\n  \nA  b\nnew\n")
    write(tmp_path / "c.de", b"x y\nok\nleer\nx y\nneu\n")
    counts = SplitCounts()
    text_filter = TextFilter(FilterSettings(), counts)
    kept = [p for line in ParallelCorpus(tmp_path / "c", "en", "de") if (p := text_filter.accept(line))]
    assert kept == [("a b", "x y"), ("A b", "x y"), ("new", "neu")]  # case matters for duplicates
    assert counts.read == 5
    assert dict(counts.rejected) == {"not_utf8": 1, "empty": 1}


def test_duplicates_after_normalisation_and_switches(tmp_path: Path) -> None:
    write(tmp_path / "c.en", b"a  b\na b\n\n")
    write(tmp_path / "c.de", b"x\nx\ny\n")
    counts = SplitCounts()
    text_filter = TextFilter(FilterSettings(), counts)
    assert [text_filter.accept(pair) for pair in ParallelCorpus(tmp_path / "c", "en", "de")] == [
        ("a b", "x"),
        None,
        None,
    ]
    assert dict(counts.rejected) == {"duplicate": 1, "empty": 1}
    counts = SplitCounts()
    text_filter = TextFilter(FilterSettings(dedup=False, keep_empty=True), counts)
    assert [text_filter.accept(pair) for pair in ParallelCorpus(tmp_path / "c", "en", "de")] == [
        ("a b", "x"),
        ("a b", "x"),
        ("", "y"),
    ]


def test_bad_utf8_in_error_mode_names_file_line_and_byte(tmp_path: Path) -> None:
    write(tmp_path / "c.en", b"ok\nok\n")
    write(tmp_path / "c.de", b"ok\nbad \xc3(\n")
    text_filter = TextFilter(FilterSettings(on_bad_line="error"), SplitCounts())
    with pytest.raises(DataError, match=r"c\.de:2: not valid UTF-8 \(byte 0xc3 at column 5\)"):
        for line in ParallelCorpus(tmp_path / "c", "en", "de"):
            text_filter.accept(line)


def test_reference_lines_must_be_utf8(tmp_path: Path) -> None:
    write(tmp_path / "t.en", b"fine\n\xfe\n")
    write(tmp_path / "t.de", b"gut\ngut\n")
    lines = list(ParallelCorpus(tmp_path / "t", "en", "de"))
    assert reference_text(lines[0]) == ("fine", "gut")
    with pytest.raises(DataError, match=r"t\.en:2: not valid UTF-8"):
        reference_text(lines[1])


def test_length_filters() -> None:
    settings = FilterSettings(max_len=10, max_ratio=3.0)
    assert length_reject(10, 10, settings) is None
    assert length_reject(11, 4, settings) == "too_long"
    assert length_reject(2, 7, settings) == "ratio"
    assert length_reject(1, 4, settings) == "ratio"
    assert length_reject(0, 10, settings) is None  # an empty side, kept by --keep-empty: no ratio (was against 1)
    assert length_reject(500, 1, FilterSettings(max_len=0, max_ratio=0)) is None
