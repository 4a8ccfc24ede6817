"""Training throughput and MFU of a config on one accelerator (transformer-big in bf16 by default).

Trains the TP=1 model for a few steps on random token batches of about ``--tokens``
target tokens (sentences of ``--len`` tokens each side) with fused Adam and prints
target tokens/s and MFU = 6 x parameters x tokens/s / peak. In bf16 the model holds its
weights in bf16 and the optimizer fp32 copies of them, as the Trainer's DeepSpeed bf16 does
(its gradients added into fp32 ones, one fused Adam step over the fp32 copies, the result
copied back): the layers compute what the Trainer's compute, in the same dtypes, so that
compiled layers are the same graphs (Inductor's cache serves a run after ``megaformer
train``). The peak is the device's dense bf16 tensor-core figure from
megaformer.train.metrics (or --peak-tflops).
Attention-score FLOPs are not counted (they are ~2 % at these lengths), so MFU is a
slight under-estimate. ``--compile`` compiles each layer as ``train.compile=true`` does
(the warm-up steps compile them; the JSON counts the graphs Inductor's cache served and
those it compiled). Runs on a CPU too (--device cpu, small --tokens) to
check the script.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaformer.cli import Parser, compile_cache_defaults  # noqa: E402

compile_cache_defaults()  # Inductor's and AOTAutograd's caches where `megaformer train` keeps them: before torch

import torch  # noqa: E402

from megaformer.cli_args import int_range, nonneg_int, positive_int  # noqa: E402
from megaformer.config import load_config  # noqa: E402
from megaformer.info import model_info  # noqa: E402
from megaformer.model import Transformer  # noqa: E402
from megaformer.parallel import LOCAL, DropoutRNG  # noqa: E402
from megaformer.train.device import configure_math  # noqa: E402
from megaformer.train.metrics import device_peak_flops  # noqa: E402


def main() -> int:
    p = Parser(prog="gpu_throughput", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/transformer_big.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--tokens", type=positive_int, default=25000, help="target tokens per step (the paper's batch)")
    p.add_argument("--len", type=positive_int, default=32, help="tokens per sentence, each side")
    p.add_argument(
        "--vocab-size", type=int_range(4), default=37000, help="pieces in the vocabulary (WMT'14 en-de's 37,000)"
    )
    p.add_argument("--steps", type=positive_int, default=20)
    p.add_argument("--warmup", type=nonneg_int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--peak-tflops", type=float, default=0.0)
    p.add_argument("--compile", action="store_true", help="compile each layer, as train.compile=true does")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    cfg = load_config(args.config, args.overrides + ["parallel.tp=1", f"data.vocab_size={args.vocab_size}"])
    device = torch.device(args.device)
    configure_math(device, args.dtype)  # TF32 for fp32 on a GPU, as in training
    model = Transformer(cfg.model, cfg.data.vocab_size, LOCAL, DropoutRNG(1, LOCAL), seed=1).to(device)
    weights = list(model.parameters())
    bf16 = args.dtype == "bf16"
    # bf16: fp32 copies of the weights for the optimizer, the model in bf16; fp32: the weights themselves
    master = [w.detach().clone() for w in weights] if bf16 else weights
    if bf16:
        for m in master:
            m.grad = torch.zeros_like(m)
        model.to(torch.bfloat16)
    if args.compile:
        model.compile_layers()
    optimizer = torch.optim.Adam(master, lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
    batch = max(1, args.tokens // args.len)
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, cfg.data.vocab_size, (batch, args.len), generator=g).to(device)
    tgt = torch.randint(4, cfg.data.vocab_size, (batch, args.len + 1), generator=g).to(device)
    tgt_in, tgt_out = tgt[:, :-1].contiguous(), tgt[:, 1:].contiguous()

    def step() -> None:
        loss, n = model.loss(src, tgt_in, tgt_out, cfg.train.label_smoothing)
        (loss / n).backward()
        if bf16:  # the fp32 gradients (one micro-batch: the sum is the copy), the update, the weights copied back
            torch._foreach_copy_([m.grad for m in master], [w.grad for w in weights])
            optimizer.step()
            torch._foreach_copy_([w.data for w in weights], master)
        else:
            optimizer.step()
        model.zero_grad(set_to_none=True)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        step()
    sync()
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    seconds = (time.perf_counter() - started) / args.steps
    graphs = torch._dynamo.utils.counters["inductor"]
    params = model_info(cfg)["parameters"]
    tokens_per_s = batch * args.len / seconds
    peak = device_peak_flops(device, args.dtype, args.peak_tflops)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "config": args.config,
        "dtype": args.dtype,
        "compiled": args.compile,
        "graphs_from_cache": graphs["fxgraph_cache_hit"],
        "graphs_compiled": graphs["fxgraph_cache_miss"],
        "parameters": params,
        "batch_sentences": batch,
        "target_tokens_per_step": batch * args.len,
        "step_seconds": seconds,
        "tokens_per_s": tokens_per_s,
        "peak_tflops": peak / 1e12,
        "mfu": 6 * params * tokens_per_s / peak if math.isfinite(peak) else float("nan"),
        "max_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['device']}: {args.config} {args.dtype}, {params / 1e6:.1f}M parameters, "
            f"{batch} x {args.len} tokens per step: {seconds * 1e3:.1f} ms/step, {tokens_per_s:,.0f} target tokens/s, "
            f"MFU {100 * result['mfu']:.1f}% of {result['peak_tflops']:.3g} TFLOP/s"
            + (f", peak memory {result['max_memory_gib']:.1f} GiB" if result["max_memory_gib"] else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
