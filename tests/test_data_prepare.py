"""`megaformer prepare` and `megaformer inspect` through the CLI: output, determinism, atomicity, errors."""

from __future__ import annotations

import gzip
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megaformer import cli
from megaformer.data import shards as shards_module
from megaformer.data.corpus import REJECT_REASONS
from megaformer.data.synthetic import write_synthetic_corpus


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code: int, err: str, command: str, *needles: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"megaformer {command}: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The built-in corpus as plain text (languages xx / yy), small."""
    return write_synthetic_corpus(tmp_path_factory.mktemp("corpus"), 1500, 120, 100, seed=3)


def prepare(capsys: pytest.CaptureFixture, corpus: dict[str, Path], out: Path, *extra: str) -> tuple[int, str, str]:
    return run_cli(
        capsys,
        "prepare",
        "--src",
        "xx",
        "--tgt",
        "yy",
        "--train",
        str(corpus["train"]),
        "--valid",
        str(corpus["valid"]),
        "--test",
        str(corpus["test"]),
        "--out",
        str(out),
        "--vocab-size",
        "500",
        "--shard-size",
        "400",
        *extra,
    )


def test_prepare_writes_shards_manifest_and_references(
    capsys: pytest.CaptureFixture, corpus: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "data"
    code, _, err = prepare(capsys, corpus, out)
    assert code == 0, err
    assert "prepare train: read 1,500 kept 1,500" in err and "lines/s" in err  # progress on stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["src_lang"] == "xx" and manifest["tgt_lang"] == "yy"
    tok = manifest["tokenizer"]
    assert tok["sha256"] == hashlib.sha256((out / "spm.model").read_bytes()).hexdigest()
    assert (tok["vocab_size"], tok["pad_id"], tok["unk_id"], tok["bos_id"], tok["eos_id"]) == (500, 0, 1, 2, 3)
    lines = {"train": 1500, "valid": 120, "test": 100}
    for split, entry in manifest["splits"].items():
        assert entry["read"] == lines[split]
        assert entry["kept"] + sum(entry["rejected"].values()) == entry["read"]
        assert set(entry["rejected"]) == set(REJECT_REASONS)
        assert entry["samples"] == entry["kept"] == sum(s["samples"] for s in entry["shards"])
        assert entry["src_tokens"] == sum(s["src_tokens"] for s in entry["shards"])
        for shard in entry["shards"]:
            assert shard["sha256"] == hashlib.sha256((out / shard["file"]).read_bytes()).hexdigest()
        assert [(s["lang"], s["lines"]) for s in entry["sources"]] == [("xx", lines[split]), ("yy", lines[split])]
        assert all(len(s["sha256"]) == 64 and Path(s["path"]).is_file() for s in entry["sources"])
    assert [s["samples"] for s in manifest["splits"]["train"]["shards"]] == [400, 400, 400, 300]
    assert manifest["splits"]["train"]["filtered"] and not manifest["splits"]["test"]["filtered"]
    # Raw references: the test text untouched, line for line.
    assert (out / "test.yy").read_text() == Path(f"{corpus['test']}.yy").read_text()
    assert manifest["splits"]["test"]["raw"] == {"src": "test.xx", "ref": "test.yy"}
    assert not list(tmp_path.glob("data.tmp-*"))


def test_same_input_gives_byte_identical_output(
    capsys: pytest.CaptureFixture, corpus: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "data"
    assert prepare(capsys, corpus, out)[0] == 0
    first = tree_digest(out)
    assert prepare(capsys, corpus, out, "--force")[0] == 0
    assert tree_digest(out) == first
    assert prepare(capsys, corpus, out, "--force", "--seed", "99")[0] == 0
    second = tree_digest(out)
    assert second["train-000000.tar"] != first["train-000000.tar"]  # the seed orders the training shards
    assert second["spm.model"] == first["spm.model"]  # all sentences used: the BPE sample seed plays no part
    assert second["test-000000.tar"] == first["test-000000.tar"]  # test keeps line order


def test_bpe_dropout_stores_sampled_segmentations_of_every_kept_pair(
    capsys: pytest.CaptureFixture, corpus: dict[str, Path], tmp_path: Path
) -> None:
    from megaformer.data.shards import read_shard
    from megaformer.data.tokenizer import Tokenizer

    plain, sampled = tmp_path / "plain", tmp_path / "sampled"
    assert prepare(capsys, corpus, plain)[0] == 0
    code, _, err = prepare(capsys, corpus, sampled, "--bpe-dropout", "0.1", "--bpe-copies", "3")
    assert code == 0, err
    first = tree_digest(sampled)
    assert prepare(capsys, corpus, sampled, "--force", "--bpe-dropout", "0.1", "--bpe-copies", "3")[0] == 0
    assert tree_digest(sampled) == first  # seeded: the same samples again
    base, entry = (json.loads((d / "manifest.json").read_text())["splits"] for d in (plain, sampled))
    assert entry["train"]["kept"] == base["train"]["kept"] == 1500
    assert entry["train"]["samples"] == 3 * 1500 and entry["train"]["bpe_dropout"] == {"p": 0.1, "copies": 3}
    assert "bpe_dropout" not in base["train"]
    assert entry["train"]["src_tokens"] > 3 * base["train"]["src_tokens"]  # skipped merges: more, smaller pieces
    assert tree_digest(sampled)["test-000000.tar"] == tree_digest(plain)["test-000000.tar"]  # plain at test time

    def texts(root: Path) -> dict[tuple[str, str], set[tuple[int, ...]]]:
        tok = Tokenizer(root / "spm.model")
        found: dict[tuple[str, str], set[tuple[int, ...]]] = {}
        for shard in json.loads((root / "manifest.json").read_text())["splits"]["train"]["shards"]:
            for _, s, t in read_shard(str(root / shard["file"])):
                found.setdefault((tok.decode(s), tok.decode(t)), set()).add(tuple(s))
        return found

    plain_pairs, sampled_pairs = texts(plain), texts(sampled)
    assert sampled_pairs.keys() == plain_pairs.keys()  # every pair, and nothing else, in other pieces
    assert sum(len(v) > 1 for v in sampled_pairs.values()) > 100  # copies differ


def test_bpe_dropout_keeps_what_the_length_filter_kept_and_nothing_longer(
    capsys: pytest.CaptureFixture, corpus: dict[str, Path], tmp_path: Path
) -> None:
    """--max-len judges the plain segmentation; a longer sampled one falls back to it."""
    limit = ("--max-len", "12")
    plain, sampled = tmp_path / "plain", tmp_path / "sampled"
    assert prepare(capsys, corpus, plain, *limit)[0] == 0
    assert prepare(capsys, corpus, sampled, *limit, "--bpe-dropout", "0.3", "--bpe-copies", "2")[0] == 0
    base, entry = (json.loads((d / "manifest.json").read_text())["splits"]["train"] for d in (plain, sampled))
    assert 0 < base["rejected"]["too_long"] == entry["rejected"]["too_long"]  # the filter is active, judged once
    assert entry["kept"] == base["kept"] and entry["samples"] == 2 * base["kept"]
    lengths = np.load(sampled / entry["lengths"]["file"])
    assert lengths.max() == 12  # sampled segmentations reach the limit, none passes it


def test_filters_count_every_reject_and_keep_every_test_line(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    train_src = ["a house", "a house", "", "ok \xff", "long " * 40, "x", "fine  day\r", "Ｆｕｌｌ width"]
    train_tgt = ["ein haus", "ein haus", "leer", "gut", "lang", "y " * 15, "schöner tag", "volle breite"]
    raw_src = "\n".join(train_src).encode().replace("\xff".encode(), b"\xff") + b"\n"
    (tmp_path / "t.en").write_bytes(raw_src)
    (tmp_path / "t.de.gz").write_bytes(gzip.compress(("\n".join(train_tgt) + "\n").encode()))
    test_src = ["same", "same", "", "very " * 300]
    (tmp_path / "e.en").write_text("\n".join(test_src) + "\n")
    (tmp_path / "e.de").write_text("gleich\ngleich\nleer\nsehr\n")
    out = tmp_path / "data"
    code, _, err = run_cli(
        capsys,
        "prepare",
        "--train",
        str(tmp_path / "t"),
        "--test",
        str(tmp_path / "e"),
        "--out",
        str(out),
        "--vocab-size",
        "60",
        "--max-len",
        "20",
        "--max-ratio",
        "5",
    )
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    train = manifest["splits"]["train"]
    assert train["read"] == 8 and train["kept"] == 3
    assert train["rejected"] == {"not_utf8": 1, "empty": 1, "duplicate": 1, "too_long": 1, "ratio": 1}
    test = manifest["splits"]["test"]
    assert test["read"] == test["kept"] == test["samples"] == 4  # duplicates, empty and long lines all kept
    assert (out / "test.en").read_text().splitlines() == test_src
    report = json.loads(run_cli(capsys, "inspect", str(out), "--json")[1])
    for split in ("train", "test"):
        assert {"read", "kept", "rejected", "padding_waste"} <= set(report["splits"][split])
    assert report["splits"]["train"]["rejected"]["duplicate"] == 1
    code, _, err = run_cli(
        capsys,
        "prepare",
        "--train",
        str(tmp_path / "t"),
        "--out",
        str(tmp_path / "strict"),
        "--vocab-size",
        "60",
        "--on-bad-line",
        "error",
    )
    assert_one_line_error(code, err, "prepare", f"{tmp_path / 't.en'}:4: not valid UTF-8 (byte 0xff")


def test_several_training_corpora_and_a_given_tokenizer(
    capsys: pytest.CaptureFixture, corpus: dict[str, Path], tmp_path: Path
) -> None:
    first = tmp_path / "first"
    assert prepare(capsys, corpus, first)[0] == 0
    out = tmp_path / "both"
    code, _, err = run_cli(
        capsys,
        "prepare",
        "--src",
        "xx",
        "--tgt",
        "yy",
        "--train",
        str(corpus["train"]),
        "--train",
        str(corpus["valid"]),
        "--out",
        str(out),
        "--spm",
        str(first / "spm.model"),
        "--no-dedup",
    )
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["splits"]["train"]["read"] == 1620 and len(manifest["splits"]["train"]["sources"]) == 4
    assert manifest["tokenizer"]["sha256"] == json.loads((first / "manifest.json").read_text())["tokenizer"]["sha256"]
    assert manifest["tokenizer"]["trained"] is False


def test_existing_output_needs_force(capsys: pytest.CaptureFixture, corpus: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "data"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = prepare(capsys, corpus, out)
    assert_one_line_error(code, err, "prepare", str(out), "--force")
    assert (out / "keep.txt").read_text() == "mine"
    # --force replaces only what prepare wrote (its manifest.json) or an empty folder: never other files
    code, _, err = prepare(capsys, corpus, out, "--force")
    assert_one_line_error(code, err, "prepare", str(out), "no manifest.json of megaformer prepare")
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    assert prepare(capsys, corpus, out, "--force")[0] == 0  # an empty folder
    first = (out / "manifest.json").read_text()
    assert prepare(capsys, corpus, out, "--force", "--seed", "7")[0] == 0  # its own earlier output
    assert (out / "manifest.json").read_text() != first
    assert not [p for p in tmp_path.iterdir() if p.name != "data"]  # no .tmp- or .old- left


def test_interrupted_run_leaves_nothing_that_looks_complete(
    capsys: pytest.CaptureFixture, corpus: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written = []

    def interrupt_after_a_few(self: shards_module.ShardWriter, src: list[int], tgt: list[int]) -> None:
        written.append(1)
        if len(written) > 700:
            raise KeyboardInterrupt
        original(self, src, tgt)

    original = shards_module.ShardWriter.write
    monkeypatch.setattr(shards_module.ShardWriter, "write", interrupt_after_a_few)
    code, _, err = prepare(capsys, corpus, tmp_path / "data")
    assert code == 130 and "interrupted" in err
    assert list(tmp_path.iterdir()) == []


def bad_input_cases(tmp_path: Path) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (extra argv, strings the one-line error must contain)."""
    good = write_synthetic_corpus(tmp_path / "good", 300, 20, 20, seed=1)
    (tmp_path / "short.xx").write_text("a\nb\nc\n")
    (tmp_path / "short.yy").write_text("a\nb\n")
    (tmp_path / "bad.xx").write_text("a\nb\n")
    (tmp_path / "bad.yy").write_bytes(b"a\nb \xe9\n")
    (tmp_path / "empty.xx").write_text("")
    (tmp_path / "empty.yy").write_text("")
    return {
        "line counts differ": (
            ["--train", str(tmp_path / "short")],
            [str(tmp_path / "short.xx"), "has 3 lines", "has 2"],
        ),
        "not utf-8 in test": (
            ["--train", str(good["train"]), "--test", str(tmp_path / "bad"), "--vocab-size", "100"],
            [f"{tmp_path / 'bad.yy'}:2: not valid UTF-8"],
        ),
        "empty file": (["--train", str(tmp_path / "empty")], [str(tmp_path / "empty.xx"), "empty"]),
        "missing file": (["--train", str(tmp_path / "nowhere")], [str(tmp_path / "nowhere.xx"), "no such file"]),
        "vocabulary too large": (
            ["--train", str(good["train"]), "--vocab-size", "5000"],
            ["--vocab-size 5000", str(good["train"]), "lower --vocab-size"],
        ),
    }


@pytest.mark.parametrize(
    "case", ["line counts differ", "not utf-8 in test", "empty file", "missing file", "vocabulary too large"]
)
def test_bad_input_is_one_line_naming_the_file(capsys: pytest.CaptureFixture, tmp_path: Path, case: str) -> None:
    extra, needles = bad_input_cases(tmp_path)[case]
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "prepare", "--src", "xx", "--tgt", "yy", "--out", str(out), "--quiet", *extra)
    assert_one_line_error(code, err, "prepare", *needles)
    assert not out.exists() and not list(tmp_path.glob("out.tmp-*"))


def test_console_errors_for_shards_and_tokenizers(
    capsys: pytest.CaptureFixture, corpus: dict[str, Path], tmp_path: Path
) -> None:
    """A real process (``python -m megaformer.cli``): exit 2, one line, no traceback."""
    out, other = tmp_path / "data", tmp_path / "other"
    assert prepare(capsys, corpus, out)[0] == 0
    assert prepare(capsys, corpus, other, "--vocab-size", "400")[0] == 0  # another tokenizer
    code, said = run_cli(capsys, "inspect", str(out), "--verify", "--spm", str(out / "spm.model"))[:2]
    assert code == 0 and "verified: " in said and "samples and sha256 as the manifest says" in said, said

    def console(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "megaformer.cli", *argv], capture_output=True, text=True, timeout=120
        )

    done = console("inspect", str(out), "--spm", str(other / "spm.model"))
    assert_one_line_error(done.returncode, done.stderr, "inspect", str(out / "manifest.json"), str(other / "spm.model"))
    shard = out / "train-000001.tar"
    shard.write_bytes(shard.read_bytes()[:30000])
    done = console("inspect", str(out), "--verify")
    assert_one_line_error(done.returncode, done.stderr, "inspect", str(shard))
    done = console("prepare", "--train", str(tmp_path / "missing"), "--out", str(tmp_path / "x"))
    assert_one_line_error(done.returncode, done.stderr, "prepare", str(tmp_path / "missing.en"))


def test_synthetic_in_one_go(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    out = tmp_path / "demo"
    code, _, err = run_cli(capsys, "prepare", "--synthetic", "400", "--out", str(out), "--quiet")
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["src_lang"], manifest["tgt_lang"]) == ("xx", "yy")
    assert {s: manifest["splits"][s]["read"] for s in ("train", "valid", "test")} == {
        "train": 400,
        "valid": 40,
        "test": 40,
    }
    assert all(Path(s["path"]).is_file() for s in manifest["splits"]["train"]["sources"])  # recorded where they end up
    code, _, err = run_cli(capsys, "prepare", "--synthetic", "10", "--train", "x", "--out", str(tmp_path / "y"))
    assert_one_line_error(code, err, "prepare", "--synthetic")


def test_text_of_only_sentences_too_long_for_sentencepiece_says_so(tmp_path):
    """sentencepiece skips sentences over 4,192 bytes and then fails with an empty reason after the colon."""
    from megaformer.data.tokenizer import train_bpe
    from megaformer.errors import DataError

    text = tmp_path / "long.txt"
    text.write_text("".join(" ".join(f"w{i}{j}" for j in range(1200)) + "\n" for i in range(3)))
    with pytest.raises(DataError, match=r"--vocab-size 60: no sentence of at most 4,192 bytes"):
        train_bpe([text], tmp_path / "spm.model", vocab_size=60, seed=1)
