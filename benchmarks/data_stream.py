"""Is the data stream fast enough, and does a batch ever wait? Stream rate, and waits at half that rate.

    python benchmarks/data_stream.py [--data DIR] [--pairs 200000] [--workers 1] [--max-tokens 4096]
        [--sort-buffer 100000] [--steps 3] [--verify-rounds N] [--json]

1. Stream: one epoch of ``TokenBatchStream`` over the training split of ``--data`` (a
   directory written by ``megaformer prepare``; without it a corpus of WMT'14 en-de's
   shape, ``prepare --synthetic PAIRS --synthetic-shape wmt14``, is prepared into a
   temporary directory) with ``--workers`` loader workers (default 1), timed from
   ``iter()`` (worker start included) to the last batch: target tokens (with eos) per
   second; the steady rate is that of the second epoch, read by the same workers.
2. Waits: a consumer that takes the stream at half that steady rate (it holds each batch
   for its target tokens / half the rate, as a step computing would) through one and a
   half epochs: at least two sort-window boundaries and one epoch boundary, where the
   next window must be read before its first batch. The time each ``next()`` blocked:
   p50, p99 and max over every batch but the first (which waits for the workers to
   start; reported apart), and at each window and epoch boundary.
3. Training: fp32 steps of the paper's base shape - ``torch.nn.Transformer`` (d_model
   512, 8 heads, d_ff 2048, 6 + 6 layers, dropout 0.1) with one shared 8000-word
   embedding scaled by sqrt(d) that is also the output projection, label smoothing
   0.1, AdamW - on a batch of 32 x 30 tokens each side; one warm-up step, then the
   median of ``--steps`` steps: target tokens per second consumed.

With ``--verify-rounds N``, N epochs each with and without the shards' sha256 check,
alternating, give the cost of verification as a ratio of medians (``verify_rate_ratio``).

The ratio stream / training should be at least 20 and no wait over 50 ms: the stream
must not be what training waits for. Both are measured in the same run (the machine
drifts between runs).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from megaformer import cli
from megaformer.cli_args import nonneg_int, positive_int
from megaformer.data.stream import TokenBatchStream
from megaformer.errors import MegaformerError

D_MODEL, HEADS, D_FF, LAYERS, VOCAB, BATCH, LENGTH = 512, 8, 2048, 6, 8000, 32, 30
TARGET_RATIO = 20.0
TARGET_WAIT_MS = 50.0


def stream_tokens_per_second(
    data: Path, workers: int, max_tokens: int, sort_buffer: int, verify: bool = True, epochs: int = 1
) -> dict:
    """The training stream read as fast as it comes: target tokens/s of the first epoch (worker start included),
    its batches and padding share; with ``epochs=2`` also the second epoch's rate, the steady one."""
    stream = TokenBatchStream(
        data, "train", dp_rank=0, dp_size=1, max_tokens=max_tokens, num_workers=workers, verify=verify,
        sort_buffer=sort_buffer,
    )  # fmt: skip
    tokens = [0] * epochs
    slots = real = batches = 0
    ended = [0.0] * epochs
    started = time.perf_counter()
    it = iter(stream)
    while stream.epoch < epochs:
        epoch = stream.epoch
        batch = next(it)
        tokens[epoch] += batch.tgt_tokens
        ended[epoch] = time.perf_counter()
        if epoch == 0:
            slots += batch.src.numel() + batch.tgt_out.numel()
            real += batch.src_tokens + batch.tgt_tokens
            batches += 1
    it.close()
    seconds = ended[0] - started
    return {
        "tokens_per_s": tokens[0] / seconds,
        "steady_tokens_per_s": tokens[-1] / (ended[-1] - ended[-2]) if epochs > 1 else tokens[0] / seconds,
        "seconds": seconds,
        "batches": batches,
        "padding_waste": 1 - real / slots,
    }


def paced_waits(data: Path, workers: int, max_tokens: int, sort_buffer: int, rate: float) -> dict:
    """Waits of a consumer taking ``rate`` target tokens/s through 1.5 epochs (>= 2 window, 1 epoch boundaries)."""
    stream = TokenBatchStream(
        data, "train", dp_rank=0, dp_size=1, max_tokens=max_tokens, num_workers=workers, sort_buffer=sort_buffer
    )
    windows = [stream.window_starts(epoch) for epoch in (0, 1)]
    boundaries = {(0, w): "window" for w in windows[0][1:]}
    boundaries.update({(1, w): "window" for w in windows[1][1:]})
    boundaries[(1, 0)] = "epoch"
    # Through the first window boundary after the epoch's: at least 2 window boundaries and the epoch's.
    later = windows[1][1:]
    end = (1, later[0] + 3) if later else (2, 3)
    if len(windows[0]) < 2 and not later:
        raise SystemExit(f"one sort window per epoch: lower --sort-buffer (now {sort_buffer}) to cross two")
    waits, at_boundaries = [], []
    batches = iter(stream)
    first_ms = None
    while (stream.epoch, stream.position) < end:
        where = (stream.epoch, stream.position)
        started = time.perf_counter()
        batch = next(batches)
        waited = (time.perf_counter() - started) * 1000
        if first_ms is None:
            first_ms = waited
        else:
            waits.append(waited)
            if where in boundaries:
                at_boundaries.append({"at": f"{boundaries[where]} (epoch {where[0]}, batch {where[1]})", "ms": waited})
        time.sleep(batch.tgt_tokens / rate)  # the step that would compute on it
    batches.close()
    ordered = sorted(waits)
    return {
        "wait_ms_p50": round(statistics.median(ordered), 3),
        "wait_ms_p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3),
        "wait_ms_max": round(ordered[-1], 3),
        "first_batch_ms": round(first_ms, 1),
        "paced_batches": len(waits) + 1,
        "boundaries": [{"at": b["at"], "ms": round(b["ms"], 3)} for b in at_boundaries],
        "consumer_tokens_per_s": round(rate, 1),
    }


class BaseTransformer(nn.Module):
    """``nn.Transformer`` of the base shape with a shared, scaled embedding tied to the output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        nn.init.normal_(self.embed.weight, 0.0, D_MODEL**-0.5)
        position = torch.arange(1024).unsqueeze(1)
        angle = position * torch.exp(torch.arange(0, D_MODEL, 2) * (-math.log(10000.0) / D_MODEL))
        table = torch.zeros(1024, D_MODEL)
        table[:, 0::2], table[:, 1::2] = torch.sin(angle), torch.cos(angle)
        self.register_buffer("positions", table, persistent=False)
        self.dropout = nn.Dropout(0.1)
        self.transformer = nn.Transformer(D_MODEL, HEADS, LAYERS, LAYERS, D_FF, 0.1, batch_first=True)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.embed(ids) * math.sqrt(D_MODEL) + self.positions[: ids.shape[1]])

    def loss(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(tgt_in.shape[1])
        hidden = self.transformer(self._embed(src), self._embed(tgt_in), tgt_mask=causal, tgt_is_causal=True)
        logits = F.linear(hidden, self.embed.weight)  # (batch, tgt_len, vocab)
        return F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), label_smoothing=0.1)


def train_tokens_per_second(steps: int) -> dict:
    """fp32 training steps of the base shape on 32 x 30 tokens: target tokens/s (median step)."""
    torch.manual_seed(0)
    model = BaseTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    src, tgt_in, tgt_out = (torch.randint(4, VOCAB, (BATCH, LENGTH)) for _ in range(3))
    times = []
    for step in range(steps + 1):  # the first step warms up allocators and kernels
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        model.loss(src, tgt_in, tgt_out).backward()
        optimizer.step()
        if step:
            times.append(time.perf_counter() - started)
    step_time = statistics.median(times)
    return {"tokens_per_s": BATCH * LENGTH / step_time, "step_s": step_time}


def verification_cost(data: Path, workers: int, max_tokens: int, sort_buffer: int, rounds: int) -> dict:
    """The stream's rate with the shards' sha256 checked against without, alternating epochs; medians and ratio."""
    rates: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for verify in (False, True):
            measured = stream_tokens_per_second(data, workers, max_tokens, sort_buffer, verify)
            rates[verify].append(measured["tokens_per_s"])
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    return {
        "verify_tokens_per_s": round(on, 1),
        "no_verify_tokens_per_s": round(off, 1),
        "verify_rate_ratio": round(on / off, 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = cli.Parser(prog="data_stream", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", type=Path, help="a prepared directory (default: a WMT'14-shaped corpus of --pairs pairs)"
    )
    parser.add_argument(
        "--pairs", type=positive_int, default=200_000, help="pairs of the WMT'14-shaped corpus (default: %(default)s)"
    )
    parser.add_argument(
        "--sort-buffer", type=positive_int, default=100_000, help="samples per sort window (default: %(default)s)"
    )
    parser.add_argument("--workers", type=nonneg_int, default=1, help="loader workers (default: %(default)s)")
    parser.add_argument(
        "--max-tokens", type=positive_int, default=4096, help="tokens per batch and side (default: %(default)s)"
    )
    parser.add_argument("--steps", type=positive_int, default=3, help="timed training steps (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--verify-rounds",
        type=nonneg_int,
        default=0,
        help="also time N epochs each with and without the shard checksums, alternating (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    try:
        return _measure(args)
    except MegaformerError as err:  # data or settings the stream refuses (--max-tokens below the longest sample)
        parser.exit(2, f"{parser.prog}: error: {err}\n")


def _measure(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data
        if data is None:
            data = Path(tmp) / "wmt14-shaped"
            argv = ["prepare", "--synthetic", str(args.pairs), "--synthetic-shape", "wmt14", "--out", str(data)]
            if cli.main([*argv, "--quiet"]) != 0:
                return 1
        stream = stream_tokens_per_second(data, args.workers, args.max_tokens, args.sort_buffer, epochs=2)
        paced = paced_waits(data, args.workers, args.max_tokens, args.sort_buffer, stream["steady_tokens_per_s"] / 2)
        cost = (
            verification_cost(data, args.workers, args.max_tokens, args.sort_buffer, args.verify_rounds)
            if args.verify_rounds
            else {}
        )
    train = train_tokens_per_second(args.steps)
    ratio = stream["tokens_per_s"] / train["tokens_per_s"]
    if args.json:
        print(
            json.dumps(
                {
                    "stream_tokens_per_s": round(stream["tokens_per_s"], 1),
                    "stream_steady_tokens_per_s": round(stream["steady_tokens_per_s"], 1),
                    "train_tokens_per_s": round(train["tokens_per_s"], 1),
                    "ratio": round(ratio, 1),
                    "workers": args.workers,
                    "max_tokens": args.max_tokens,
                    "stream_batches": stream["batches"],
                    "stream_seconds": round(stream["seconds"], 3),
                    "padding_waste": round(stream["padding_waste"], 4),
                    "train_step_s": round(train["step_s"], 3),
                    "data": str(args.data or f"WMT'14-shaped corpus ({args.pairs} pairs)"),
                    "sort_buffer": args.sort_buffer,
                    **paced,
                    **cost,
                }
            )
        )
    else:
        print(
            f"stream: {stream['tokens_per_s']:,.0f} target tokens/s with {args.workers} worker(s) "
            f"({stream['batches']} batches of <= {args.max_tokens} tokens in {stream['seconds']:.2f}s, "
            f"padding {stream['padding_waste']:.1%})"
        )
        print(
            f"train:  {train['tokens_per_s']:,.0f} target tokens/s (base shape, fp32, {BATCH}x{LENGTH}, "
            f"median step {train['step_s']:.2f}s)"
        )
        print(f"ratio:  {ratio:,.1f} (the stream should deliver at least {TARGET_RATIO:.0f}x what training consumes)")
        print(
            f"waits at half the steady rate ({paced['consumer_tokens_per_s']:,.0f} tokens/s, {paced['paced_batches']} "
            f"batches): p50 {paced['wait_ms_p50']:.2f} ms, p99 {paced['wait_ms_p99']:.2f} ms, max "
            f"{paced['wait_ms_max']:.2f} ms (target <= {TARGET_WAIT_MS:.0f}); first batch {paced['first_batch_ms']:.0f} ms"
        )
        for b in paced["boundaries"]:
            print(f"        {b['at']}: {b['ms']:.2f} ms")
        if cost:
            print(
                f"verify: {cost['verify_tokens_per_s']:,.0f} target tokens/s with shard checksums, "
                f"{cost['no_verify_tokens_per_s']:,.0f} without: {cost['verify_rate_ratio']:.3f}x "
                f"(medians of {args.verify_rounds} alternating epochs)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
