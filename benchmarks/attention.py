"""Forward + backward of one attention call: SDPA's fused kernel against megaformer's matmul path.

    python benchmarks/attention.py [--device cpu|cuda] [--json] [--repeats N]

For each shape (batch, heads, length, head_dim: the base model's 32 x 8 x 30 x 64 and
longer sequences), masked and causal, in fp32 and bf16, times
``scaled_dot_product_attention`` (the fused kernel the device picks) and
:func:`megaformer.model.attention.matmul_attention` (q k^T, fp32 softmax, times v),
alternating the two (A B A B) and taking medians. ``attend`` uses the matmul path on a
CPU up to 48 keys in fp32 and 128 in bf16; the last column says which one it picks.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from megaformer.cli import Parser
from megaformer.cli_args import positive_int
from megaformer.model.attention import matmul_attention, uses_matmul_attention
from megaformer.parallel import LOCAL, DropoutRNG

SHAPES = [(32, 8, 30, 64), (64, 4, 24, 64), (16, 4, 64, 64), (8, 8, 128, 64), (4, 8, 256, 64)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _inputs(shape, dtype, device, causal):
    b, _, t, _ = shape
    q, k, v = (torch.randn(shape, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    mask = None if causal else torch.ones(b, 1, 1, t, dtype=torch.bool, device=device)
    return q, k, v, mask, torch.randn(shape, dtype=dtype, device=device)


def _time(fn, device) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(shape, dtype: str, causal: bool, device: str, repeats: int) -> dict:
    q, k, v, mask, grad = _inputs(shape, DTYPES[dtype], device, causal)
    rng = DropoutRNG(1, LOCAL)

    def fused():
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal).backward(grad)

    def matmul():
        matmul_attention(q, k, v, mask, causal, 0.0, rng).backward(grad)

    times = {"fused": [], "matmul": []}
    for i in range(repeats + 2):
        for name, fn in (("fused", fused), ("matmul", matmul)):
            seconds = _time(fn, device)
            if i >= 2:
                times[name].append(seconds)
    fused_ms, matmul_ms = (statistics.median(times[n]) * 1e3 for n in ("fused", "matmul"))
    return {
        "shape": list(shape),
        "dtype": dtype,
        "mask": "causal" if causal else "padding",
        "fused_ms": round(fused_ms, 3),
        "matmul_ms": round(matmul_ms, 3),
        "fused_over_matmul": round(fused_ms / matmul_ms, 2),
        "attend_uses": "matmul" if uses_matmul_attention(q, k, 0.0) else "fused",
    }


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--json", action="store_true")
    p.add_argument("--repeats", type=positive_int, default=10)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    rows = []
    for dtype in DTYPES:
        for shape in SHAPES:
            for causal in (False, True):
                rows.append(measure(shape, dtype, causal, args.device, args.repeats))
                if not args.json:
                    r = rows[-1]
                    print(
                        f"{dtype:5s} {'x'.join(map(str, r['shape'])):14s} {r['mask']:8s} fused {r['fused_ms']:7.2f} ms"
                        f"  matmul {r['matmul_ms']:7.2f} ms  fused/matmul {r['fused_over_matmul']:5.2f}"
                        f"  attend uses {r['attend_uses']}",
                        flush=True,
                    )
    if args.json:
        print(json.dumps({"device": args.device, "threads": torch.get_num_threads(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
