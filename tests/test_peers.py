"""benchmarks/peers without the peers: the recipe they are given, their budget's clock, the data they read.

The comparison itself (``bash benchmarks/peers/run.sh MINUTES``) trains for minutes and is not part of the suite.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

import budget as peer_budget  # noqa: E402
import compare  # noqa: E402
import peer_fairseq  # noqa: E402
import peer_opennmt  # noqa: E402
import text  # noqa: E402

from megaformer.recipes.multi30k import Machine  # noqa: E402

ONEDNN_CPU = Machine(gpus=0, native_bf16=True, onednn_fp32=True)


def test_the_15_minute_fp32_recipe_as_numbers():
    """Worked by hand from configs/multi30k.yaml and the recipe: 1,350 expected steps of 3,000 tokens -> the fp32
    hour's settings: peak 1.1132 / sqrt(256) / sqrt(1000) = 2.2e-3, pre-LN, 1,000-token steps, dropout 0.15."""
    r = compare.recipe("15", "fp32", ONEDNN_CPU)
    assert r["peak_lr"] == pytest.approx(2.2e-3, rel=1e-3)
    assert (r["norm"], r["tokens_per_step"], r["dropout"], r["warmup_max"]) == ("pre", 1000, 0.15, 1000)
    assert (r["warmup_fraction"], r["saves"], r["average"], r["beam"], r["lenpen"]) == (0.2, 24, 5, 4, 2.0)
    assert (r["d_model"], r["d_ff"], r["heads"], r["encoder_layers"], r["decoder_layers"]) == (256, 1024, 4, 3, 3)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_budget_fits_the_warmup_saves_and_ends(monkeypatch):
    """1 minute at 0.125 s an update: 480 updates expected, the warm-up a fifth of them (at most warmup_max), a save
    every 2.5 s (23, the wrappers' 24th when the minutes are spent), spent after 60 s; the lr peaks at the recipe's
    peak at the fitted warm-up and halves at four times it."""
    clock = FakeClock()
    monkeypatch.setattr(peer_budget.time, "perf_counter", clock)
    spec = {**compare.recipe("1", "fp32", ONEDNN_CPU), "minutes": 1.0}
    b = peer_budget.Budget(spec)
    saves, update = 0, 0
    while not b.spent():
        update += 1
        b.observe(update)
        saves += b.save_due()
        clock.now += 0.125
    assert update == 480
    assert b.warmup == pytest.approx(0.2 * 480, abs=2)
    assert saves == 23
    assert max(b.lr(u) for u in range(1, 480)) == pytest.approx(spec["peak_lr"], rel=1e-6)
    assert b.lr(b.warmup) == pytest.approx(spec["peak_lr"], rel=1e-6)
    assert b.lr(4 * b.warmup) == pytest.approx(spec["peak_lr"] / 2, rel=1e-6)


def test_the_peers_get_the_recipe_on_their_options(tmp_path):
    r = compare.recipe("15", "fp32", ONEDNN_CPU)
    args = peer_fairseq.train_args(r, tmp_path / "bin", tmp_path / "ckpt")
    value = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
    assert "--encoder-normalize-before" in args and "--decoder-normalize-before" in args
    assert (value["--max-tokens"], value["--dropout"], value["--encoder-ffn-embed-dim"]) == ("1000", "0.15", "1024")
    shared = text.Shared(tmp_path, tmp_path, tmp_path / "spm.model", 1000, 15.0, 40, 28997)
    assert peer_fairseq.lenpen(r, shared) == pytest.approx(1.5)  # 2.0 x 15 / 20: GNMT's slope at 15 pieces
    onmt = peer_opennmt.config(r, shared, tmp_path)
    assert (onmt["hidden_size"], onmt["transformer_ff"], onmt["heads"], onmt["batch_size"]) == (256, 1024, 4, 1000)
    assert onmt["dropout"] == [0.15] and onmt["share_embeddings"] and onmt["add_qkvbias"]
    assert onmt["bucket_size"] == 28997  # one copy of the corpus a bucket, not OpenNMT-py's ~9
    assert value["--required-batch-size-multiple"] == "1"


def test_the_peers_read_megaformers_prepared_pairs_as_pieces(tmp_path, monkeypatch):
    """The exported pieces are the prepared shards' token ids, pair for pair (checked against the manifest's
    lengths), and the test source is the raw test file through the same sentencepiece model."""
    import gzip

    import numpy as np

    from megaformer.data.shards import open_prepared

    raw = tmp_path / "raw"
    raw.mkdir()
    pairs = [(f"a small dog number {i} runs", f"ein kleiner hund nummer {i} rennt") for i in range(400)]
    for split, rows in (("train", pairs), ("val", pairs[:20]), ("test_2016_flickr", pairs[20:40])):
        for side, lang in ((0, "en"), (1, "de")):
            with gzip.open(raw / f"{split}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.write("".join(row[side] + "\n" for row in rows))
    monkeypatch.setattr(text.m30k, "VOCAB", 120)  # the recipe's 8,000 pieces need more text than this
    shared = text.prepare(raw, tmp_path / "work", "test_2016_flickr")
    lengths = open_prepared(shared.data, "train").lengths
    src = (shared.text / "train.en").read_text(encoding="utf-8").splitlines()
    tgt = (shared.text / "train.de").read_text(encoding="utf-8").splitlines()
    got = np.array([[len(s.split()), len(t.split())] for s, t in zip(src, tgt, strict=True)])
    assert sorted(map(tuple, got)) == sorted(map(tuple, lengths))
    detok = sorted(text.detokenize(shared.spm, src))
    assert detok == sorted(p[0] for p in pairs)
    test = (shared.text / "test.en").read_text(encoding="utf-8").splitlines()
    assert text.detokenize(shared.spm, test) == [p[0] for p in pairs[20:40]]
    assert shared.test_lines == 20


def test_compare_refuses_bad_options_in_one_line(tmp_path, capsys):
    from megaformer.errors import ConfigError

    with pytest.raises(ConfigError, match="MINUTES=soon"):
        compare.parse_args(["--minutes", "soon", "--peers", str(tmp_path)])
    for bad in (["--precisions", "fp16"], ["--systems", "marian"], ["--systems", "fairseq"]):
        with pytest.raises(SystemExit) as exit_:
            compare.parse_args(["--minutes", "15", "--peers", str(tmp_path), *bad])
        assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "fp16" in err and "marian" in err and "install.sh" in err


def test_wrappers_refuse_a_bad_command_line():
    with pytest.raises(SystemExit, match="BUDGET.json SUMMARY.json -- TOOL"):
        peer_budget.wrapper_command(["budget.json", "summary.json", "--no-dashes"], "TOOL")
