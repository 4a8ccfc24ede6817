"""Is the data stream fast enough for a GPU, and does a batch ever wait? Stream rate, waits and GIL cost at a GPU's pace.

    python benchmarks/data_stream.py [--data DIR] [--pairs 200000] [--workers 1] [--max-tokens 4096]
        [--sort-buffer 100000] [--target-tokens-per-s N] [--steps 3] [--verify-rounds N] [--json]

1. Stream: one epoch of ``TokenBatchStream`` over the training split of ``--data`` (a
   directory written by ``megaformer prepare``; without it a corpus of WMT'14 en-de's
   shape, ``prepare --synthetic PAIRS --synthetic-shape wmt14``, is prepared into a
   temporary directory) with ``--workers`` loader workers (default 1), timed from
   ``iter()`` (worker start included) to the last batch: target tokens (with eos) per
   second; the steady rate is that of the second epoch, read by the same workers.
2. Waits at a GPU's pace: a consumer that takes the stream at ``--target-tokens-per-s``
   (default: the ``target_tokens_per_s`` of ``benchmarks/gpu_sim.py --config
   configs/transformer_big.yaml --gpu h200 --json``, transformer_big's simulated step on an
   H200; 306,000, a 40 % MFU step there, when the simulation is missing or fails; the output
   says which) through one and a half epochs: at least two sort-window boundaries and one epoch
   boundary, where the next window must be read before its first batch. For each batch the
   main thread *dispatches* for the step's time (its target tokens / the rate): it runs small
   tensor operators in a loop, holding the GIL between them as an eager training step's
   dispatch does, instead of sleeping. Reported: the time each ``next()`` blocked (p50, p99,
   max and total over every batch but the first, which waits for the workers to start and is
   reported apart; and at each window and epoch boundary), and the main thread's lost time: the
   dispatch loop's operators per second with no stream running (measured in the same run, just
   before and just after the paced epochs) against those it managed beside the stream, whose
   threads (read-ahead, collation, the next epoch's plan) take the GIL from it; each step's
   shortfall times its length, summed. On a machine with fewer cores than threads and workers,
   core sharing counts as lost time too.
3. Training: fp32 steps of the paper's base shape - ``torch.nn.Transformer`` (d_model
   512, 8 heads, d_ff 2048, 6 + 6 layers, dropout 0.1) with one shared 8000-word
   embedding scaled by sqrt(d) that is also the output projection, label smoothing
   0.1, AdamW - on a batch of 32 x 30 tokens each side; one warm-up step, then the
   median of ``--steps`` steps: target tokens per second consumed on this CPU.

With ``--verify-rounds N``, N epochs each with and without the shards' sha256 check,
alternating, give the cost of verification as a ratio of medians (``verify_rate_ratio``).

The stream should keep up with the GPU's rate with no wait over 50 ms, and the ratio
stream / CPU training should be at least 20: the stream must not be what training waits
for. All are measured in the same run (the machine drifts between runs).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from megaformer import cli
from megaformer.cli_args import finite_float, nonneg_int, positive_int
from megaformer.data.stream import TokenBatchStream
from megaformer.errors import MegaformerError

D_MODEL, HEADS, D_FF, LAYERS, VOCAB, BATCH, LENGTH = 512, 8, 2048, 6, 8000, 32, 30
TARGET_RATIO = 20.0
TARGET_WAIT_MS = 50.0
ROOT = Path(__file__).resolve().parents[1]
GPU_RATE = 306_000.0  # target tokens/s of a transformer_big step at 40 % MFU on an H200 (6 x 176M x tok/s = 0.4 x 989T)
SIM_SECONDS = 180  # the most the simulation may take before GPU_RATE is used instead
CALIBRATION_S = 2.0  # the dispatch loop alone, before and after the paced epochs


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


def json_of(text: str) -> dict:
    """The JSON object a script printed: all of its output (indented or not), or its last line."""
    text = text.strip()
    try:
        return json.loads(text)
    except ValueError:
        return json.loads(text.splitlines()[-1] if text else "")


def gpu_rate(target: float | None) -> tuple[float, str]:
    """The consumer's target tokens/s and where it came from: ``--target-tokens-per-s``, else the simulated
    transformer_big step on an H200 (``benchmarks/gpu_sim.py``), else :data:`GPU_RATE`."""
    if target is not None:
        return target, "--target-tokens-per-s"
    sim = ROOT / "benchmarks" / "gpu_sim.py"
    argv = [sys.executable, str(sim), "--config", str(ROOT / "configs" / "transformer_big.yaml"), "--gpu", "h200"]
    why = "benchmarks/gpu_sim.py is missing"
    if sim.is_file():
        try:
            done = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=SIM_SECONDS, cwd=ROOT)
            if done.returncode != 0:
                last = done.stderr.strip().splitlines()[-1:] or ["no message"]
                raise RuntimeError(f"gpu_sim.py exited {done.returncode}: {last[0]}")
            sim_result = json_of(done.stdout)
            rate = float(sim_result["target_tokens_per_s"])
            if not (math.isfinite(rate) and rate > 0):
                raise RuntimeError(f"gpu_sim.py predicted {rate} target tokens/s")
            mfu = sim_result.get("predicted_mfu")
            said = f", predicted MFU {100 * float(mfu):.1f} %" if isinstance(mfu, (int, float)) else ""
            return rate, f"gpu_sim.py (transformer_big on an H200{said})"
        except subprocess.TimeoutExpired:
            why = f"gpu_sim.py took over {SIM_SECONDS} s"
        except RuntimeError as err:
            why = str(err)
        except (ValueError, KeyError, TypeError) as err:
            why = f"gpu_sim.py printed no target_tokens_per_s ({type(err).__name__})"
    return GPU_RATE, f"the fallback {GPU_RATE:,.0f}, a 40 % MFU transformer_big step on an H200 ({why})"


class Dispatch:
    """The host side of an eager training step: small tensor operators in a loop, each holding the GIL while Python
    dispatches it (torch lets go of it inside the operator, as in a real step)."""

    def __init__(self) -> None:
        self.a, self.b = torch.rand(64), torch.rand(64)

    def run(self, seconds: float) -> int:
        """Dispatch for ``seconds``; the loop's rounds (3 operators each)."""
        a, b = self.a, self.b
        rounds = 0
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            c = torch.add(a, b)
            c.mul_(0.5)
            b = c.relu()
            rounds += 1
        return rounds

    def alone(self, seconds: float = CALIBRATION_S) -> float:
        """Rounds per second with nothing else running in this process."""
        began = time.perf_counter()
        rounds = self.run(seconds)
        return rounds / (time.perf_counter() - began)


def paced_waits(data: Path, workers: int, max_tokens: int, sort_buffer: int, rate: float) -> dict:
    """Waits of a consumer taking ``rate`` target tokens/s through 1.5 epochs (>= 2 window, 1 epoch boundaries),
    its main thread dispatching for each step's time, and the dispatch it lost to the stream's threads."""
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
    dispatch = Dispatch()
    alone_before = dispatch.alone()
    waits, at_boundaries, steps = [], [], []  # steps: (seconds dispatched, rounds done)
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
        began = time.perf_counter()
        rounds = dispatch.run(batch.tgt_tokens / rate)  # the step that would dispatch its kernels for this batch
        steps.append((time.perf_counter() - began, rounds))
    batches.close()
    alone_after = dispatch.alone()
    alone = (alone_before + alone_after) / 2
    dispatched = sum(seconds for seconds, _ in steps)
    lost = [max(0.0, seconds - rounds / alone) for seconds, rounds in steps]  # each step's shortfall, in seconds
    ordered = sorted(waits)
    return {
        "wait_ms_p50": round(statistics.median(ordered), 3),
        "wait_ms_p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3),
        "wait_ms_max": round(ordered[-1], 3),
        "wait_ms_total": round(sum(ordered), 1),
        "first_batch_ms": round(first_ms, 1),
        "paced_batches": len(waits) + 1,
        "boundaries": [{"at": b["at"], "ms": round(b["ms"], 3)} for b in at_boundaries],
        "consumer_tokens_per_s": round(rate, 1),
        "dispatch_s": round(dispatched, 3),
        "dispatch_rounds_per_s_alone": round(alone, 1),
        "dispatch_rounds_per_s_alone_before_after": [round(alone_before, 1), round(alone_after, 1)],
        "dispatch_rounds_per_s_with_stream": round(sum(r for _, r in steps) / dispatched, 1),
        "dispatch_lost_ms_total": round(1000 * sum(lost), 1),
        "dispatch_lost_share": round(sum(lost) / dispatched, 4),
        "dispatch_lost_ms_max_step": round(1000 * max(lost), 3),
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
    parser.add_argument(
        "--target-tokens-per-s",
        type=finite_float(0.0, lo_open=True),
        help="the consumer's pace (default: gpu_sim.py's transformer_big step on an H200, else 306,000)",
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
        rate, source = gpu_rate(args.target_tokens_per_s)
        paced = paced_waits(data, args.workers, args.max_tokens, args.sort_buffer, rate)
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
                    "consumer_rate_source": source,
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
        print(f"pace:   {paced['consumer_tokens_per_s']:,.0f} target tokens/s, from {source}")
        print(
            f"waits at that pace ({paced['paced_batches']} batches, the main thread dispatching): p50 "
            f"{paced['wait_ms_p50']:.2f} ms, p99 {paced['wait_ms_p99']:.2f} ms, max {paced['wait_ms_max']:.2f} ms "
            f"(target <= {TARGET_WAIT_MS:.0f}), total {paced['wait_ms_total']:,.0f} ms; first batch "
            f"{paced['first_batch_ms']:.0f} ms"
        )
        print(
            f"dispatch: {paced['dispatch_lost_ms_total']:,.0f} ms of {paced['dispatch_s']:.1f} s lost beside the stream "
            f"({100 * paced['dispatch_lost_share']:.1f} %; worst step {paced['dispatch_lost_ms_max_step']:.1f} ms): "
            f"{paced['dispatch_rounds_per_s_with_stream']:,.0f} rounds/s against {paced['dispatch_rounds_per_s_alone']:,.0f} "
            f"alone"
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
