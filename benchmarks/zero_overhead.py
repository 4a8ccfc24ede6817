"""ZeRO-2 against ZeRO-0 step time, 2 data-parallel ranks on this machine, in one run.

A base-shaped model (d_model 512, 8 heads, d_ff 2048, vocabulary 8000; --layers N+N,
default 2+2 so that it runs in minutes on 2 CPU cores) trains on random batches of 16
sentences x 30 tokens per rank, fp32, one gloo process per rank with one thread each.
Variants are timed in turn, round after round (median step time of each), so that
drift hits all of them alike:

- zero0: plain data parallelism (DeepSpeed's bucketed all-reduce), full Adam on each rank;
- zero2-default: DeepSpeed's ZeRO-2 with its defaults (5e8-element buckets, contiguous
  gradients, reduce-scatter, no overlap);
- zero2-ours: megaformer's defaults (train.zero_*: 5e7-element buckets, and on a CPU no
  contiguous-gradient copy).

Prints each variant's step time and its overhead against zero0; --json for one object.
``--variant NAME:key=value,key=value`` adds a variant (any config override), to try
other settings in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = {
    "zero0": ["train.zero_stage=0"],
    "zero2-default": [
        "train.zero_stage=2",
        "train.zero_bucket_size=500000000",
        "train.zero_overlap_comm=false",
        "train.zero_reduce_scatter=true",
        "train.zero_contiguous_gradients=true",
    ],
}


def _worker(args: argparse.Namespace, variants: dict[str, list[str]], out: str) -> int:
    import torch

    from megaformer.config import load_config
    from megaformer.data.stream import Batch
    from megaformer.model import Transformer
    from megaformer.parallel import DropoutRNG, ParallelContext
    from megaformer.parity import random_batch
    from megaformer.train.engine import build_engine
    from megaformer.train.feed import MicroBatch
    from megaformer.train.step import accumulate

    rank = int(os.environ["RANK"])
    base = [
        f"model.encoder_layers={args.layers}",
        f"model.decoder_layers={args.layers}",
        "data.vocab_size=8000",
        "parallel.tp=1",
    ]
    ctx = None
    engines = {}
    for name, sets in variants.items():
        cfg = load_config(ROOT / "configs" / "transformer_base.yaml", base + sets + ["train.precision=fp32"])
        if ctx is None:
            ctx = ParallelContext.initialize(cfg.parallel, rank, 2)
        model = Transformer(cfg.model, cfg.data.vocab_size, ctx.tp, DropoutRNG(1, ctx.tp, ctx.dp_rank), seed=1)
        engines[name] = (build_engine(cfg, ctx, model, accumulation=1), cfg)
    src, tgt_in, tgt_out = random_batch(8000, args.batch, 30, 30, seed=rank)
    batch = Batch(src, tgt_in, tgt_out, int(src.ne(0).sum()), int(tgt_out.ne(0).sum()))
    micro = [MicroBatch(0, batch)]  # one stream: its dropout state is the model's own
    tokens = batch.tgt_tokens * 2
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(args.warmup + args.rounds):
        for name, (engine, _cfg) in engines.items():
            torch.distributed.barrier()
            began = time.perf_counter()
            accumulate(engine, micro, tokens, 0.1, lambda stream: nullcontext())
            torch.distributed.barrier()
            if round_ >= args.warmup:
                times[name].append(time.perf_counter() - began)
    if rank == 0:
        Path(out).write_text(
            json.dumps({name: {"median": statistics.median(t), "min": min(t)} for name, t in times.items()})
        )
    return 0


def main() -> int:
    from megaformer.cli import Parser
    from megaformer.cli_args import nonneg_int, positive_int

    p = Parser(prog="zero_overhead", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=positive_int, default=2)
    p.add_argument("--batch", type=positive_int, default=16, help="sentences per rank per step")
    p.add_argument("--rounds", type=positive_int, default=10)
    p.add_argument("--warmup", type=nonneg_int, default=2)
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE,...",
        help="an extra variant, e.g. zero2-small:train.zero_stage=2,train.zero_bucket_size=5000000",
    )
    args = p.parse_args()

    from launcher.local import spawn

    variants = dict(VARIANTS)
    variants["zero2-ours"] = ["train.zero_stage=2"]  # megaformer's defaults for everything else
    for spec in args.variant:
        name, _, sets = spec.partition(":")
        if not name or not sets:
            p.error(f"--variant {spec!r}: expected NAME:key=value[,key=value...]")
        variants[name] = sets.split(",")
    out = ROOT / ".cache" / "zero_overhead.json"
    out.parent.mkdir(exist_ok=True)
    if spawn(_worker, 2, args, variants, str(out)) != 0:
        print("zero_overhead: a rank failed", file=sys.stderr)
        return 1
    measured = json.loads(out.read_text())
    medians = {k: v["median"] for k, v in measured.items()}
    fastest = {k: v["min"] for k, v in measured.items()}
    result = {
        "layers": args.layers,
        "batch_per_rank": args.batch,
        "ranks": 2,
        "rounds": args.rounds,
        "step_seconds": medians,
        "step_seconds_min": fastest,
        "overhead_vs_zero0": {k: v / medians["zero0"] - 1 for k, v in medians.items() if k != "zero0"},
        "overhead_vs_zero0_min": {k: v / fastest["zero0"] - 1 for k, v in fastest.items() if k != "zero0"},
        "settings": variants,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{'variant':20s} {'median ms':>10s} {'vs zero0':>9s} {'min ms':>8s} {'vs zero0':>9s}")
        for name in medians:
            if name == "zero0":
                print(f"{name:20s} {medians[name] * 1e3:10.1f} {'':9s} {fastest[name] * 1e3:8.1f}")
            else:
                print(
                    f"{name:20s} {medians[name] * 1e3:10.1f} {result['overhead_vs_zero0'][name]:+9.1%} "
                    f"{fastest[name] * 1e3:8.1f} {result['overhead_vs_zero0_min'][name]:+9.1%}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
