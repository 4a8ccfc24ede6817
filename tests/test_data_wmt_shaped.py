"""The WMT'14-shaped corpus: deterministic, WMT's length profile and tail, a vocabulary that fills 37,000 pieces."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megaformer import cli
from megaformer.data import wmt_shaped


def test_same_seed_same_text_other_seed_other_text() -> None:
    a, b, c = wmt_shaped.generate(300, 1), wmt_shaped.generate(300, 1), wmt_shaped.generate(300, 2)
    assert a == b and a[0] != c[0]
    assert len(a[0]) == len(a[1]) == 300 and all(a[0]) and all(a[1])


def test_word_lengths_have_wmt_profile_and_a_long_tail() -> None:
    """Source words: mean ~19 (x ~1.4 pieces a word under 37k BPE: ~27), 99th percentile ~60, a tail to 200."""
    src, tgt = wmt_shaped.generate(40_000, 0)
    src_len = np.array([len(s.split()) for s in src])
    tgt_len = np.array([len(t.split()) for t in tgt])
    assert 17.5 < src_len.mean() < 20.5
    assert 50 < np.percentile(src_len, 99) < 80 and src_len.max() > 120
    assert src_len.max() <= wmt_shaped.MAX_WORDS and src_len.min() >= 1
    ratio = tgt_len / src_len
    assert 0.95 < np.median(ratio) < 1.05 and np.corrcoef(src_len, tgt_len)[0, 1] > 0.95
    # Zipf's law: the most frequent word is ~5 % of the running words (as "the" in English), most types rare.
    words, counts = np.unique(" ".join(src).split(), return_counts=True)
    assert 0.03 < counts.max() / counts.sum() < 0.08 and len(words) > 20_000


def test_prepare_shape_wmt14(tmp_path: Path) -> None:
    out = tmp_path / "data"
    argv = ["prepare", "--synthetic", "3000", "--synthetic-shape", "wmt14", "--vocab-size", "4000", "--out", str(out)]
    assert cli.main([*argv, "--quiet"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["src_lang"], manifest["tgt_lang"]) == ("xs", "ys")
    assert manifest["tokenizer"]["vocab_size"] == 4000
    assert manifest["splits"]["train"]["samples"] > 2900 and manifest["splits"]["valid"]["samples"] == 300


def test_shape_without_synthetic_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    status = cli.main(["prepare", "--train", "x", "--synthetic-shape", "wmt14", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert status == 2 and "--synthetic-shape wmt14" in err and "--synthetic N" in err and "\n" == err[-1]
