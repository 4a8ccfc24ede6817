"""Forward + backward of the vocab-parallel loss against ``F.cross_entropy``, one thread, logits of two spreads.

    python benchmarks/loss.py [--tokens N] [--vocab V] [--dtype fp32|bf16] [--repeats N] [--json]

A Multi30k micro-batch's logits (1,400 tokens x 8,064 pieces, fp32 or, as a bf16 run's
vocabulary projection gives them, bf16; label smoothing 0.1) at two spreads: ``init`` (standard normal, every probability a normal fp32
number, as at initialisation) and ``trained`` (standard deviation 30: ~80 % of the
probabilities below fp32's smallest normal number, as a trained model's logits put
most of the vocabulary). The CPU's ``exp`` takes a slow path for every result that
would be subnormal or zero; :func:`megaformer.parallel.vocab_parallel_cross_entropy`
raises the shifted logits to ``log(tiny) + 1`` first (see its module). Both losses run
alternately (A B A B) on the same logits; medians. The reference, ``F.cross_entropy``,
is torch's fused log-softmax, on fp32 logits as autocast gives it bf16 ones (its gradient
then flows back through the cast); the ratio is megaformer's time over it.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time

from megaformer.cli import Parser, host_memory_defaults
from megaformer.cli_args import positive_int

host_memory_defaults()  # as `megaformer train` runs: torch reads it at its first allocation

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megaformer.parallel import LOCAL, vocab_parallel_cross_entropy  # noqa: E402

SPREADS = {"init": 1.0, "trained": 30.0}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _step(logits: torch.Tensor, target: torch.Tensor, ours: bool) -> float:
    x = logits.detach().requires_grad_()
    start = time.perf_counter()
    if ours:
        loss = vocab_parallel_cross_entropy(x, target, LOCAL, x.shape[1], 0.1).sum()
    else:
        loss = F.cross_entropy(x.float(), target, label_smoothing=0.1, reduction="sum")
    loss.backward()
    return time.perf_counter() - start


def run(tokens: int, vocab: int, repeats: int, dtype: torch.dtype = torch.float32) -> dict:
    torch.set_num_threads(1)  # a rank of `make multi30k`
    g = torch.Generator().manual_seed(0)
    target = torch.randint(4, vocab, (tokens,), generator=g)
    result: dict = {"tokens": tokens, "vocab": vocab, "dtype": str(dtype).removeprefix("torch."), "threads": 1}
    for name, spread in SPREADS.items():
        logits = torch.randn(tokens, vocab, generator=g) * spread
        shifted = logits - logits.amax(-1, keepdim=True)
        below = (shifted < math.log(torch.finfo(torch.float32).tiny)).float().mean()
        logits = logits.to(dtype)
        times: dict[str, list[float]] = {"megaformer": [], "reference": []}
        for i in range(repeats + 1):
            for label, ours in (("megaformer", True), ("reference", False)):
                seconds = _step(logits, target, ours)
                if i:  # the first round warms up
                    times[label].append(seconds)
        ours, ref = (statistics.median(times[k]) for k in ("megaformer", "reference"))
        result[name] = {"below_tiny": round(below.item(), 3), "megaformer_ms": ours * 1e3, "reference_ms": ref * 1e3}
        result[name]["ratio"] = ours / ref
    return result


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="loss", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=positive_int, default=1400)
    p.add_argument("--vocab", type=positive_int, default=8064)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--repeats", type=positive_int, default=9)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    r = run(args.tokens, args.vocab, args.repeats, DTYPES[args.dtype])
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(
        f"{args.tokens} tokens x {args.vocab} logits, {args.dtype}, label smoothing 0.1, forward + backward, one thread"
    )
    print(f"{'logits':10s} {'below tiny':>10s} {'megaformer ms':>14s} {'F.cross_entropy ms':>19s} {'ratio':>6s}")
    for name in SPREADS:
        row = r[name]
        print(
            f"{name:10s} {row['below_tiny']:10.0%} {row['megaformer_ms']:14.1f} {row['reference_ms']:19.1f} "
            f"{row['ratio']:6.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
