"""Acceptance on the real data: Multi30k en-de from ../shared/data/multi30k beside the checkout (skipped where absent)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from megaformer import cli
from megaformer.config import DataConfig
from megaformer.data.stream import PlanSettings, TokenBatchStream, open_prepared, padding_waste, plan_epoch

MULTI30K = Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k"  # as CI lays it out
pytestmark = pytest.mark.skipif(not (MULTI30K / "train.en.gz").is_file(), reason=f"Multi30k not found in {MULTI30K}")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    out = tmp_path_factory.mktemp("multi30k") / "data"
    started = time.monotonic()
    code = cli.main(
        [
            "prepare",
            "--src",
            "en",
            "--tgt",
            "de",
            "--train",
            str(MULTI30K / "train"),
            "--valid",
            str(MULTI30K / "val"),
            "--test",
            str(MULTI30K / "test_2016_flickr"),
            "--out",
            str(out),
            "--vocab-size",
            "8000",
            "--quiet",
        ]
    )
    assert code == 0
    return out, time.monotonic() - started


def test_prepare_multi30k_in_under_two_minutes(prepared: tuple[Path, float]) -> None:
    out, seconds = prepared
    print(f"prepare on Multi30k en-de: {seconds:.1f}s")
    assert seconds < 120
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokenizer"]["vocab_size"] == 8000
    lines = {"train": 29000, "valid": 1014, "test": 1000}
    for split, entry in manifest["splits"].items():
        assert entry["read"] == lines[split]
        assert entry["kept"] + sum(entry["rejected"].values()) == entry["read"]
    assert manifest["splits"]["test"]["kept"] == 1000  # a BLEU test set keeps its line count
    assert len((out / "test.de").read_text(encoding="utf-8").splitlines()) == 1000


def test_padding_waste_at_4096_tokens(prepared: tuple[Path, float]) -> None:
    out, _ = prepared
    defaults = DataConfig()
    data = open_prepared(out)
    settings = PlanSettings(
        dp_size=1,
        max_tokens=4096,
        max_len=defaults.max_len,
        shuffle_buffer=defaults.shuffle_buffer,
        sort_buffer=defaults.sort_buffer,
        seed=defaults.seed,
        shuffle=True,
    )
    waste = [padding_waste(plan_epoch(data, settings, epoch)[0].batches, data.lengths) for epoch in (0, 1)]
    print(f"padding waste at 4096 tokens on Multi30k train: {waste[0]:.2%} (epoch 0), {waste[1]:.2%} (epoch 1)")
    assert max(waste) <= 0.05
    report = json.loads(_inspect_json(out))
    assert report["splits"]["train"]["padding_waste"] <= 0.05


def _inspect_json(out: Path) -> str:
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert cli.main(["inspect", str(out), "--json", "--max-tokens", "4096"]) == 0
    return buffer.getvalue()


def test_streamed_batches_respect_the_budget(prepared: tuple[Path, float]) -> None:
    out, _ = prepared
    stream = TokenBatchStream(out, "train", dp_rank=0, dp_size=1, max_tokens=4096, num_workers=1, repeat=False)
    slots = real = count = 0
    for batch in stream:
        assert batch.src.numel() <= 4096 and batch.tgt_out.numel() <= 4096
        slots += batch.src.numel() + batch.tgt_out.numel()
        real += batch.src_tokens + batch.tgt_tokens
        count += len(batch)
    assert count == len(open_prepared(out).lengths) and 1 - real / slots <= 0.05
