"""Every stateful component takes back exactly what its ``state_dict()`` gave, and goes on as if never stopped.

One test per component: the engine (weights, Adam moments, step counts, the lr schedule
with its cool-down), the data feed and its streams, the dropout streams, the trainer's
own counters. Each compares what comes after a round trip (through JSON where the state
lives in meta.json) with what comes after no round trip at all.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import torch

from launcher.local import spawn
from megaformer import cli
from megaformer.config import load_config
from megaformer.parallel import LOCAL, DropoutRNG

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"


def _json(state: dict) -> dict:
    return json.loads(json.dumps(state))


def test_dropout_streams_round_trip():
    rng = DropoutRNG(5, LOCAL)
    x = torch.ones(64, 64)
    rng.dropout(x, 0.3, True)  # move the streams on
    state = _json(rng.state_dict())
    after = [rng.dropout(x, 0.3, True) for _ in range(3)]
    fresh = DropoutRNG(5, LOCAL)
    fresh.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(after, [fresh.dropout(x, 0.3, True) for _ in range(3)]))
    assert fresh.state_dict() == rng.state_dict()


def test_data_feed_and_its_streams_round_trip(tmp_path):
    from megaformer.data.stream import TokenBatchStream
    from megaformer.train.feed import DataFeed

    data = tmp_path / "data"
    assert cli.main(["prepare", "--synthetic", "800", "--out", str(data), "--shard-size", "200", "--quiet"]) == 0

    def stream(index: int, count: int, split: str = "train") -> TokenBatchStream:
        return TokenBatchStream(data, split, dp_rank=index, dp_size=count, max_tokens=256, sort_buffer=300, seed=3)

    def feed() -> DataFeed:
        return DataFeed(stream, 2, 0, 1, 2, DropoutRNG(1, LOCAL), 1)

    one = feed()
    for _ in range(7):  # into the second epoch of at least one stream
        one.next_step()
    state = _json(one.state_dict())
    resumed = feed()
    resumed.load_state_dict(state)
    assert _json(resumed.state_dict()) == state
    for _ in range(5):
        a, b = one.next_step(), resumed.next_step()
        assert [m.stream for m in a] == [m.stream for m in b]
        assert all(
            torch.equal(x.batch.src, y.batch.src) and torch.equal(x.batch.tgt_out, y.batch.tgt_out)
            for x, y in zip(a, b)
        )


def _engine_worker() -> int:
    from megaformer.data.stream import Batch
    from megaformer.model import Transformer
    from megaformer.parallel import ParallelContext
    from megaformer.parity import random_batch
    from megaformer.train.engine import build_engine
    from megaformer.train.feed import MicroBatch
    from megaformer.train.schedule import Cooldown
    from megaformer.train.step import accumulate

    cfg = load_config(TINY, ["parallel.backend=gloo", "model.dropout=0", "train.warmup_steps=4"])
    ctx = ParallelContext.initialize(cfg.parallel, 0, 1, single_process_group=True)
    src, tgt_in, tgt_out = random_batch(cfg.data.vocab_size, 4, 9, 7, seed=2)
    batch = Batch(src, tgt_in, tgt_out, int(src.ne(0).sum()), int(tgt_out.ne(0).sum()))

    def step(engine) -> None:
        accumulate(engine, [MicroBatch(0, batch)], batch.tgt_tokens, 0.1, lambda stream: nullcontext())

    def engine():
        model = Transformer(cfg.model, cfg.data.vocab_size, ctx.tp, DropoutRNG(1, ctx.tp), seed=7)
        return build_engine(cfg, ctx, model, 1)

    a = engine()
    for _ in range(3):
        step(a)
    a.set_cooldown(Cooldown(3, 4))
    state = a.state_dict()
    state = {"tensors": state["tensors"], "counters": _json(state["counters"])}  # counters live in meta.json
    b = engine()  # another seed's weights would do too: everything is replaced
    b.load_state_dict(state)
    assert b.state_dict()["counters"] == a.state_dict()["counters"]
    assert b.cooldown == Cooldown(3, 4) and b.lr() == a.lr()
    for _ in range(2):
        step(a)
        step(b)
        assert b.lr() == a.lr()
    for (name, p), (_, q) in zip(a.module.named_parameters(), b.module.named_parameters()):
        assert torch.equal(p, q), name
    ctx.destroy()
    return 0


def test_engine_round_trips_weights_moments_counters_and_the_cooldown():
    assert spawn(_engine_worker, 1) == 0
