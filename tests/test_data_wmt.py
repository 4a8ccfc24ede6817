"""`megaformer prepare` on WMT's downloads as they are: archives read in place and SGML (megaformer.data.wmt)."""

from __future__ import annotations

import hashlib
import json
import tarfile
from pathlib import Path

import pytest
from cli_helpers import tree_digest
from wmt14_tree import build_wmt14_tree, write_archive

from megaformer.data.wmt import member_pairs, split_archive

TRAIN_ARCHIVES = (
    "training-parallel-europarl-v7.tgz",
    "training-parallel-commoncrawl.tgz",
    "training-parallel-nc-v9.tgz",
)
TRAIN_PLAIN = ("europarl-v7", "commoncrawl", "news-commentary-v9")
SMALL = ("--vocab-size", "150", "--shard-size", "100", "--spm-sentences", "0")


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wmt14_tree(tmp_path_factory.mktemp("wmt14"))


def prepare(run, out: Path, train: list[str], valid: str, test: str, *extra: str) -> tuple[int, str, str]:
    argv = ["prepare", "--src", "en", "--tgt", "de", *SMALL, "--out", out, "--valid", valid, "--test", test]
    for corpus in train:
        argv += ["--train", corpus]
    return run(*argv, *extra)


def comparable(out: Path) -> tuple[dict, dict]:
    """The manifest without the names of what was read (paths, corpus names, file checksums), and the other files."""
    manifest = json.loads((out / "manifest.json").read_text())
    for split in manifest["splits"].values():
        for source in split["sources"]:
            del source["path"], source["sha256"]
        for corpus in split.get("corpora", []):
            del corpus["name"]
    files = {name: digest for name, digest in tree_digest(out).items() if name != "manifest.json"}
    return manifest, files


def test_archives_and_sgml_prepare_as_the_same_text_in_plain_files(run, tree: Path, tmp_path: Path) -> None:
    plain = tree / "plain"
    code, _, err = prepare(
        run, tmp_path / "a", [str(tree / a) for a in TRAIN_ARCHIVES], f"{tree}/dev.tgz:newstest2013",
        f"{tree}/test-full.tgz:newstest2014",
    )  # fmt: skip
    assert code == 0, err
    code, _, err2 = prepare(
        run, tmp_path / "p", [str(plain / p) for p in TRAIN_PLAIN], str(plain / "newstest2013"),
        str(plain / "newstest2014"), "--quiet",
    )  # fmt: skip
    assert code == 0, err2
    assert comparable(tmp_path / "a") == comparable(tmp_path / "p")
    # The test text as prepare keeps it for BLEU: the entities of the SGML decoded.
    assert (tmp_path / "a" / "test.de").read_bytes() == (plain / "newstest2014.de").read_bytes()
    assert '"Müller & Söhne"' in (tmp_path / "a" / "test.de").read_text()
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    train = manifest["splits"]["train"]
    europarl = f"{tree}/training-parallel-europarl-v7.tgz:training/europarl-v7.de-en"
    assert [c["name"] for c in train["corpora"]] == [
        europarl,
        f"{tree}/training-parallel-commoncrawl.tgz:commoncrawl.de-en",
        f"{tree}/training-parallel-nc-v9.tgz:training/news-commentary-v9.de-en",
    ]
    assert [c["read"] for c in train["corpora"]] == [120, 75, 45]
    for key in ("read", "kept"):
        assert sum(c[key] for c in train["corpora"]) == train[key]
    assert [s["path"] for s in train["sources"][:2]] == [f"{europarl}.en", f"{europarl}.de"]
    for source, name in zip(train["sources"], [f"{p}.{lang}" for p in TRAIN_PLAIN for lang in ("en", "de")]):
        assert source["text_sha256"] == hashlib.sha256((plain / name).read_bytes()).hexdigest()
    test_sources = manifest["splits"]["test"]["sources"]
    assert [s["path"] for s in test_sources] == [
        f"{tree}/test-full.tgz:test-full/newstest2014-deen-src.en.sgm",
        f"{tree}/test-full.tgz:test-full/newstest2014-deen-ref.de.sgm",
    ]
    # The summary counts each corpus, as the manifest does.
    assert f"prepare train {europarl}: read 120 kept " in err


def test_sgml_pair_prefix_and_extracted_members_read_as_the_archive(run, tree: Path, tmp_path: Path) -> None:
    """The same downloads extracted: text members as prefixes, newstest2014 as its SGML pair prefix."""
    for archive in (*TRAIN_ARCHIVES, "dev.tgz", "test-full.tgz"):
        with tarfile.open(tree / archive) as tar:
            tar.extractall(tmp_path / "x", filter="data")
    x = tmp_path / "x"
    train = [x / "training/europarl-v7.de-en", x / "commoncrawl.de-en", x / "training/news-commentary-v9.de-en"]
    code, _, err = prepare(
        run, tmp_path / "e", [str(t) for t in train], str(x / "dev/newstest2013"),
        str(x / "test-full/newstest2014-deen"), "--quiet",
    )  # fmt: skip
    assert code == 0, err
    plain = tree / "plain"
    code, _, err = prepare(
        run, tmp_path / "p", [str(plain / p) for p in TRAIN_PLAIN], str(plain / "newstest2013"),
        str(plain / "newstest2014"), "--quiet",
    )  # fmt: skip
    assert code == 0, err
    assert comparable(tmp_path / "e") == comparable(tmp_path / "p")
    sources = json.loads((tmp_path / "e" / "manifest.json").read_text())["splits"]
    assert sources["valid"]["sources"][0]["path"].endswith("dev/newstest2013.en")  # text wins over the SGML beside it
    assert sources["test"]["sources"][1]["path"].endswith("test-full/newstest2014-deen-ref.de.sgm")


def test_pairs_are_found_by_wmt_names_either_way_round() -> None:
    members = [
        "training/europarl-v7.de-en.de",
        "training/europarl-v7.de-en.en",
        "training/europarl-v7.fr-en.en",
        "training/europarl-v7.fr-en.fr",
        "commoncrawl.de-en.annotation",
        "dev/newstest2013-src.en.sgm",
        "dev/newstest2013-ref.de.sgm",
        "dev/newstest2013-src.de.sgm",
        "dev/newstest2013-ref.en.sgm",
        "dev/newstest2013.en",
    ]
    ours, others = member_pairs(members, "en", "de")
    assert [(p.src, p.tgt) for p in ours] == [
        ("dev/newstest2013-src.en.sgm", "dev/newstest2013-ref.de.sgm"),
        ("training/europarl-v7.de-en.en", "training/europarl-v7.de-en.de"),
    ]
    assert {p.src for p in others} == {"dev/newstest2013-src.de.sgm", "training/europarl-v7.fr-en.fr"}
    ours, _ = member_pairs(members, "de", "en")
    assert [(p.src, p.tgt) for p in ours][1] == ("training/europarl-v7.de-en.de", "training/europarl-v7.de-en.en")
    assert split_archive("a/dev.tgz:newstest2013") == (Path("a/dev.tgz"), "newstest2013")
    assert split_archive("a/x.tar.gz") == (Path("a/x.tar.gz"), None)
    assert split_archive("data:v1/train") is None


SRC_SGML = """<srcset setid="t" srclang="any">
<doc sysid="ref" docid="a-1" genre="news" origlang="en">
<p>
<seg id="1">One &amp; two</seg>
<seg id="2">Three</seg>
</p>
</doc>
<doc docid="b-2">
<seg id="1">Four</seg>
</doc>
</srcset>
"""
REF_SGML = SRC_SGML.replace("srcset", "refset").replace("One", "Eins").replace("Three", "Drei").replace("Four", "Vier")


def bad_input(tree: Path, tmp: Path, case: str) -> tuple[list[str], list[str]]:
    """(prepare's arguments after the languages, what the one-line error must name) for one bad input."""
    good = ["--train", str(tree / "plain" / "train")]

    def sgml(src: str = SRC_SGML, ref: str = REF_SGML) -> list[str]:
        (tmp / "t-src.en.sgm").write_text(src)
        (tmp / "t-ref.de.sgm").write_text(ref)
        return [*good, "--test", str(tmp / "t")]

    lines = {f"c.de-en.{lang}": "".join(f"line {i}\n" for i in range(n)).encode() for lang, n in (("en", 5), ("de", 4))}
    fr = {"training/europarl-v7.fr-en.en": b"a\n", "training/europarl-v7.fr-en.fr": b"b\n"}
    archive = tree / "training-parallel-europarl-v7.tgz"
    cases = {
        "sides differ in an archive": lambda: (
            ["--train", str(write_archive(tmp / "c.tgz", {"training/" + k: v for k, v in lines.items()}))],
            [f"{tmp}/c.tgz:training/c.de-en.en has 5 lines", f"{tmp}/c.tgz:training/c.de-en.de has 4"],
        ),
        "archive without the pair": lambda: (
            ["--train", str(write_archive(tmp / "fr.tgz", fr))],
            [f"{tmp}/fr.tgz: no en-de pair", "it holds training/europarl-v7.fr-en.fr + training/europarl-v7.fr-en.en"],
        ),
        "unclosed segment": lambda: (
            sgml(src=SRC_SGML.replace("Three</seg>", "Three")),
            [f"{tmp}/t-src.en.sgm:5: ", "not closed"],
        ),
        "segment without id": lambda: (
            sgml(ref=REF_SGML.replace('<seg id="2">', "<seg>")),
            [f"{tmp}/t-ref.de.sgm:5: a <seg> without an id"],
        ),
        "text outside a segment": lambda: (
            sgml(src=SRC_SGML.replace("</p>", "stray</p>")),
            [f"{tmp}/t-src.en.sgm:6: text outside any <seg>: 'stray'"],
        ),
        "segment ids with a gap": lambda: (
            sgml(ref=REF_SGML.replace('<seg id="2">', '<seg id="3">')),
            [f"{tmp}/t-ref.de.sgm:5: document a-1: segment id 3 where 2 was due"],
        ),
        "documents that differ": lambda: (
            sgml(ref=REF_SGML.replace('docid="b-2"', 'docid="c-3"')),
            [f"{tmp}/t-ref.de.sgm:9: document c-3 segment 1 where {tmp}/t-src.en.sgm:9 has document b-2 segment 1"],
        ),
        "reference ends early": lambda: (
            sgml(ref=REF_SGML.replace('<doc docid="b-2">\n<seg id="1">Vier</seg>\n</doc>\n', "")),
            [f"{tmp}/t-src.en.sgm:9: document b-2 segment 1 has no counterpart: {tmp}/t-ref.de.sgm ends before it"],
        ),
        "reference missing": lambda: (
            [*good, "--valid", str(_write(tmp / "r-src.en.sgm", SRC_SGML).parent / "r")],
            [f"{tmp}/r-ref.de.sgm: no such file", "r-src.en.sgm with r-ref.de.sgm"],
        ),
        "NAME matching nothing": lambda: (
            [*good, "--valid", f"{tree}/dev.tgz:newstest2099"],
            [
                f"{tree}/dev.tgz:newstest2099: no en-de pair",
                "dev/newstest2013-src.en.sgm + dev/newstest2013-ref.de.sgm",
            ],
        ),
        "several pairs for --test": lambda: (
            [*good, "--test", f"{tree}/dev.tgz"],
            [f"--test {tree}/dev.tgz: 2 en-de pairs", "add :NAME", f"--test {tree}/dev.tgz:newstest2012"],
        ),
        "truncated archive": lambda: (
            ["--train", str(_cut(archive, tmp / "cut.tgz", 0.5))],
            [f"{tmp}/cut.tgz: cannot be read as a tar archive", "truncated or damaged?"],
        ),
        "archive without its last bytes": lambda: (
            ["--train", str(_cut(archive, tmp / "end.tgz", -4))],
            [f"{tmp}/end.tgz: cannot be read as a tar archive"],
        ),
        "archive missing": lambda: (["--train", f"{tmp}/none.tgz:x"], [f"{tmp}/none.tgz: no such file"]),
    }
    return cases[case]()


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _cut(archive: Path, to: Path, keep: float) -> Path:
    data = archive.read_bytes()
    to.write_bytes(data[: int(len(data) * keep)] if keep > 0 else data[: int(keep)])
    return to


BAD = [
    "sides differ in an archive",
    "archive without the pair",
    "unclosed segment",
    "segment without id",
    "text outside a segment",
    "segment ids with a gap",
    "documents that differ",
    "reference ends early",
    "reference missing",
    "NAME matching nothing",
    "several pairs for --test",
    "truncated archive",
    "archive without its last bytes",
    "archive missing",
]


@pytest.mark.parametrize("case", BAD)
def test_a_bad_input_is_one_line_and_writes_nothing(run, tree: Path, tmp_path: Path, case: str) -> None:
    argv, needles = bad_input(tree, tmp_path, case)
    before = tree_digest(tree)
    out = tmp_path / "made" / "out"
    code, said, err = run("prepare", "--src", "en", "--tgt", "de", *SMALL, "--quiet", "--out", out, *argv)
    assert code == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megaformer prepare: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert not out.exists() and not (out.parent.exists() and list(out.parent.iterdir()))
    assert tree_digest(tree) == before


def test_nothing_is_written_when_a_side_is_found_short_while_streaming(run, tree: Path, tmp_path: Path) -> None:
    """The line counts of an archive's sides differ only at their end, long after the output folder was begun."""
    argv, _ = bad_input(tree, tmp_path, "sides differ in an archive")
    out = tmp_path / "out"
    code, _, err = run("prepare", "--src", "en", "--tgt", "de", *SMALL, "--quiet", "--out", out, *argv)
    assert code == 2 and "line counts differ" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.tgz"]  # no out, no hidden .out.tmp-*


def test_each_corpus_counts_its_own_rejects(run, tree: Path, tmp_path: Path) -> None:
    """A corpus given twice: its second reading is all duplicates; the length filter's rejects stay with their corpus."""
    europarl, nc = str(tree / TRAIN_ARCHIVES[0]), str(tree / TRAIN_ARCHIVES[2])
    limit = ("--max-len", "32", "--quiet")
    test = f"{tree}/test-full.tgz:newstest2014"
    code, _, err = prepare(
        run, tmp_path / "all", [europarl, str(tree / "plain" / TRAIN_PLAIN[0]), nc], test, test, *limit
    )
    assert code == 0, err
    spm = ("--spm", str(tmp_path / "all" / "spm.model"))
    for name, train in (("e", europarl), ("n", nc)):
        code, _, err = run("prepare", "--out", tmp_path / name, "--train", train, "--test", test, *spm, *limit)
        assert code == 0, err
    corpora = [json.loads((tmp_path / d / "manifest.json").read_text())["splits"]["train"]["corpora"] for d in "en"]
    both = json.loads((tmp_path / "all" / "manifest.json").read_text())["splits"]["train"]
    assert 0 < both["corpora"][0]["rejected"]["too_long"] < 120  # the filter is at work, and keeps some
    assert [{k: c[k] for k in ("read", "kept", "rejected")} for c in both["corpora"]] == [
        {k: corpora[0][0][k] for k in ("read", "kept", "rejected")},
        {"read": 120, "kept": 0, "rejected": {"not_utf8": 0, "empty": 0, "duplicate": 120, "too_long": 0, "ratio": 0}},
        {k: corpora[1][0][k] for k in ("read", "kept", "rejected")},
    ]
    assert sum(c["kept"] for c in both["corpora"]) == both["kept"] == both["samples"]
