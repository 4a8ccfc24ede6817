"""Training throughput of megaformer against ``torch.nn.Transformer``, one process, base shape.

    python benchmarks/throughput.py [--dtype fp32|bf16] [--compile] [--json] [--steps N] [--warmup N]

Both models are the paper's base Transformer (d_model 512, 8 heads, d_ff 2048, 6 + 6
post-LN layers, one shared 8000-word embedding scaled by sqrt(d) that is also the
output projection, sinusoidal positions, dropout 0.1 on the embeddings and every
sub-layer output, label smoothing 0.1), trained on one batch of 32 sentences x 30
tokens each side (no padding) with the same fused AdamW. The reference is
``torch.nn.Transformer`` plus that embedding; it also carries the final encoder and
decoder LayerNorms that ``nn.Transformer`` always builds (2 x 1024 parameters).
``nn.Transformer``'s ``dropout`` also drops attention probabilities and the
feed-forward activations, which the paper (and megaformer's base config) does not:
by default the reference has those two turned off, so both models drop the same
tensors; ``--reference-dropout everywhere`` keeps ``nn.Transformer``'s own placement.

Steps of the two models alternate (A B A B ...) so that drift on a shared machine
hits both alike; each model's step time is the median of its steps. The matmul peak
is measured in the same run (square ``torch.mm`` of the chosen dtype, n = 2048,
median of several, before and after the steps), and

    fraction of peak = 6 x parameters x target tokens / step time / peak

with the same parameter count for both (the paper model's, without megaformer's
vocabulary padding rows), so the fractions compare like the throughputs do.

``--compile`` adds a third model, megaformer with ``train.compile``'s regional
``torch.compile`` of its layers (:meth:`Transformer.compile_layers`), the same
weights and batch, in the same alternation; its compilation happens in the warm-up
steps and is reported apart.

Both models run in one process with the CPU memory set-up of ``megaformer train``:
tensors of 2 MiB or more in transparent huge pages (``THP_MEM_ALLOC_ENABLE=1``, set
before torch is imported, :func:`megaformer.cli.host_memory_defaults`);
``THP_MEM_ALLOC_ENABLE=0 python benchmarks/throughput.py`` runs both without.

``--dtype bf16`` runs both models under ``torch.autocast("cpu", torch.bfloat16)``
with fp32 weights and optimizer state (matmuls in bf16, losses in fp32), and
compares them with the bf16 matmul peak. On a CPU that only emulates bf16 (no
AVX512-BF16 or AMX-BF16, or oneDNN capped below them by ``ONEDNN_MAX_CPU_ISA``) it
says so in one line and exits with status 3; ``--emulated-bf16`` runs it anyway.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext

from megaformer.cli import Parser, host_memory_defaults
from megaformer.cli_args import nonneg_int, positive_int

host_memory_defaults()  # torch reads it at its first allocation

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from megaformer.config import ModelConfig  # noqa: E402
from megaformer.model import Transformer, sinusoidal_positions  # noqa: E402
from megaformer.parallel import LOCAL, DropoutRNG  # noqa: E402
from megaformer.train.device import cpu_bf16_missing  # noqa: E402

D_MODEL, HEADS, D_FF, LAYERS = 512, 8, 2048, 6
VOCAB, DROPOUT, LABEL_SMOOTHING = 8000, 0.1, 0.1
BATCH, LENGTH = 32, 30
PEAK_N = 2048
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class ReferenceTransformer(nn.Module):
    """``torch.nn.Transformer`` with the paper's shared, scaled embedding and tied output projection."""

    def __init__(self, dropout_everywhere: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        nn.init.normal_(self.embed.weight, 0.0, D_MODEL**-0.5)
        self.register_buffer("positions", sinusoidal_positions(1024, D_MODEL), persistent=False)
        self.dropout = nn.Dropout(DROPOUT)
        self.transformer = nn.Transformer(D_MODEL, HEADS, LAYERS, LAYERS, D_FF, DROPOUT, batch_first=True)
        if not dropout_everywhere:  # the paper's placement: sub-layer outputs and embeddings only
            for layer in [*self.transformer.encoder.layers, *self.transformer.decoder.layers]:
                layer.dropout = nn.Identity()  # inside the feed-forward network
                layer.self_attn.dropout = 0.0  # on attention probabilities
                if hasattr(layer, "multihead_attn"):
                    layer.multihead_attn.dropout = 0.0

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) * math.sqrt(D_MODEL) + self.positions[: ids.shape[1]]
        return self.dropout(x)

    def loss(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> tuple[torch.Tensor, int]:
        causal = nn.Transformer.generate_square_subsequent_mask(tgt_in.shape[1])
        hidden = self.transformer(
            self.embed_tokens(src), self.embed_tokens(tgt_in), tgt_mask=causal, tgt_is_causal=True
        )
        logits = F.linear(hidden, self.embed.weight)  # (batch, tgt_len, vocab)
        # Like megaformer's vocab-parallel loss, the cross-entropy is computed in fp32.
        total = F.cross_entropy(
            logits.flatten(0, 1).float(), tgt_out.flatten(), label_smoothing=LABEL_SMOOTHING, reduction="sum"
        )
        return total, tgt_out.numel()


def megaformer_model() -> Transformer:
    cfg = ModelConfig(
        d_model=D_MODEL, d_ff=D_FF, num_heads=HEADS, encoder_layers=LAYERS, decoder_layers=LAYERS, dropout=DROPOUT
    )
    return Transformer(cfg, VOCAB, LOCAL, DropoutRNG(1, LOCAL), seed=1)


def paper_parameters(model: Transformer) -> int:
    """megaformer's parameter count without the vocabulary padding rows of its embedding."""
    padding_rows = model.embed.weight.shape[0] - VOCAB
    return sum(p.numel() for p in model.parameters()) - padding_rows * D_MODEL


def make_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, VOCAB, (BATCH, LENGTH), generator=g)  # ids 0-3 are special; 0 is padding
    tgt = torch.randint(4, VOCAB, (BATCH, LENGTH + 1), generator=g)
    return src, tgt[:, :-1].contiguous(), tgt[:, 1:].contiguous()


def training_step(model: nn.Module, loss_fn: Callable[[], tuple[torch.Tensor, int]], bf16: bool) -> Callable[[], float]:
    """A closure that runs one optimizer step and returns its wall time in seconds."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
    model.train()

    def step() -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", torch.bfloat16) if bf16 else nullcontext():
            total, ntokens = loss_fn()
        (total / ntokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    return step


def matmul_gflops(dtype: torch.dtype, n: int = PEAK_N, repeats: int = 7) -> list[float]:
    """GFLOP/s of ``repeats`` square n x n matmuls (after two warm-up products)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    samples = []
    for i in range(repeats + 2):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        if i >= 2:
            samples.append(2 * n**3 / (time.perf_counter() - start) / 1e9)
    return samples


def run(
    dtype: str, steps: int, warmup: int, reference_dropout: str, compile_layers: bool, log: Callable[[str], None]
) -> dict:
    torch.manual_seed(0)
    bf16 = dtype == "bf16"
    src, tgt_in, tgt_out = make_batch()
    target_tokens = tgt_out.numel()

    mega = megaformer_model()
    ref = ReferenceTransformer(dropout_everywhere=reference_dropout == "everywhere")
    parameters = paper_parameters(mega)
    log(
        f"parameters {parameters / 1e6:.1f}M (reference {sum(p.numel() for p in ref.parameters()) / 1e6:.1f}M), "
        f"{target_tokens} target tokens a step, dtype {dtype}, {torch.get_num_threads()} threads, "
        f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE')}"
    )

    peak_samples = matmul_gflops(DTYPES[dtype])
    steppers = {
        "megaformer": training_step(mega, lambda: mega.loss(src, tgt_in, tgt_out, LABEL_SMOOTHING), bf16),
        "reference": training_step(ref, lambda: ref.loss(src, tgt_in, tgt_out), bf16),
    }
    if compile_layers:
        compiled = megaformer_model()
        compiled.compile_layers()
        steppers["compiled"] = training_step(
            compiled, lambda: compiled.loss(src, tgt_in, tgt_out, LABEL_SMOOTHING), bf16
        )
    times: dict[str, list[float]] = {name: [] for name in steppers}
    for i in range(warmup + steps):
        this_round = {name: step() for name, step in steppers.items()}  # A B A B: drift hits both alike
        if i == 0 and compile_layers:
            first_compiled = this_round["compiled"]  # mostly compilation
        if i >= warmup:
            for name, seconds in this_round.items():
                times[name].append(seconds)
        log(
            f"step {i + 1}/{warmup + steps}{' (warm-up)' if i < warmup else ''}: "
            + ", ".join(f"{name} {seconds:.3f}s" for name, seconds in this_round.items())
        )
    peak_samples += matmul_gflops(DTYPES[dtype])
    peak = statistics.median(peak_samples)

    flop_per_step = 6 * parameters * target_tokens
    result: dict = {"dtype": dtype, "parameters": parameters, "target_tokens_per_step": target_tokens}
    for name, samples in times.items():
        seconds = statistics.median(samples)
        result[f"{name}_step_s"] = seconds
        result[f"{name}_tokens_per_s"] = target_tokens / seconds
        result[f"{name}_peak_fraction"] = flop_per_step / seconds / (peak * 1e9)
        result[f"{name}_step_times_s"] = [round(t, 4) for t in samples]
    result["ratio"] = result["megaformer_tokens_per_s"] / result["reference_tokens_per_s"]
    if compile_layers:
        result["compiled_ratio"] = result["compiled_tokens_per_s"] / result["reference_tokens_per_s"]
        result["compiled_first_step_s"] = round(first_compiled, 1)
    result["peak_gflops"] = peak
    result["peak_gflops_samples"] = [round(g, 1) for g in peak_samples]
    result["peak_matmul"] = f"torch.mm {PEAK_N}x{PEAK_N} {dtype}, median"
    result["precision"] = "autocast(cpu, bfloat16), fp32 weights" if bf16 else "fp32"
    result["optimizer"] = "AdamW(fused=True), both models"
    result["reference_dropout"] = reference_dropout
    result["threads"] = torch.get_num_threads()
    result["thp_mem_alloc"] = os.environ.get("THP_MEM_ALLOC_ENABLE")
    result["torch"] = torch.__version__
    return result


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="throughput", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--json", action="store_true", help="print one JSON object (progress goes to stderr)")
    p.add_argument("--steps", type=positive_int, default=6, help="timed steps per model")
    p.add_argument("--warmup", type=nonneg_int, default=2, help="untimed steps per model first")
    p.add_argument(
        "--reference-dropout",
        choices=("paper", "everywhere"),
        default="paper",
        help="paper: nn.Transformer drops only what megaformer drops; everywhere: also attention and FFN activations",
    )
    p.add_argument("--compile", action="store_true", help="also time megaformer with its layers compiled")
    p.add_argument(
        "--emulated-bf16", action="store_true", help="run --dtype bf16 even where the CPU only emulates it (slow)"
    )
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be at least 1 and --warmup at least 0")
    if args.compile and args.warmup < 1:
        p.error("--compile needs at least one warm-up step (the compilation)")

    def log(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    if args.dtype == "bf16" and not args.emulated_bf16 and (missing := cpu_bf16_missing()) is not None:
        print(
            f"throughput: --dtype bf16 not measured: {missing}; use --dtype fp32 (or --emulated-bf16)", file=sys.stderr
        )
        return 3

    r = run(args.dtype, args.steps, args.warmup, args.reference_dropout, args.compile, log)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(
        f"\nmatmul peak ({r['peak_matmul']}): {r['peak_gflops']:.0f} GFLOP/s; "
        f"6 x {r['parameters'] / 1e6:.1f}M parameters x {r['target_tokens_per_step']} tokens "
        f"= {6 * r['parameters'] * r['target_tokens_per_step'] / 1e9:.0f} GFLOP a step"
    )
    print(f"{'model':22s} {'step s':>8s} {'target tok/s':>13s} {'of peak':>8s}")
    rows = [("megaformer", "megaformer"), ("reference", "torch.nn.Transformer")]
    if args.compile:
        rows.insert(1, ("compiled", "megaformer, compiled"))
    for name, label in rows:
        print(
            f"{label:22s} {r[f'{name}_step_s']:8.3f} {r[f'{name}_tokens_per_s']:13.0f} "
            f"{r[f'{name}_peak_fraction']:8.1%}"
        )
    print(
        f"ratio (megaformer / reference): {r['ratio']:.2f}  "
        f"[{r['precision']}; {r['optimizer']}; reference dropout: {r['reference_dropout']}]"
    )
    if args.compile:
        print(
            f"ratio (compiled megaformer / reference): {r['compiled_ratio']:.2f}; "
            f"first compiled step (compilation): {r['compiled_first_step_s']:.1f}s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
