"""``megaformer info``: parameters, FLOPs per target token and memory per rank of a config.

Counts come from the model itself, built on the ``meta`` device (no memory, no
initialisation), at TP=1 and at the configured TP size; the vocabulary padding rows
are reported apart and excluded from ``parameters``.
"""

from __future__ import annotations

import argparse
import json

import torch

from megaformer.cli_args import existing_file
from megaformer.config import Config, load_config
from megaformer.parallel import DropoutRNG, TPGroup, check_model_split, padded_vocab_size

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def _shape_model(cfg: Config, tp_size: int) -> torch.nn.Module:
    from megaformer.model import Transformer

    tp = TPGroup(group=None, size=tp_size, rank=0)
    with torch.device("meta"):
        return Transformer(
            cfg.model,
            cfg.data.vocab_size,
            tp,
            DropoutRNG(0, tp),
            sequence_parallel=cfg.parallel.sequence_parallel,
            vocab_multiple=cfg.parallel.vocab_multiple,
        )


def model_info(cfg: Config) -> dict:
    """Parameter counts, training FLOPs per target token and a per-rank memory estimate."""
    m, p = cfg.model, cfg.parallel
    check_model_split(m, p.tp)
    dp = max(1, p.dp)
    padded = padded_vocab_size(cfg.data.vocab_size, p.tp, p.vocab_multiple)
    pad_rows = (padded - cfg.data.vocab_size) * m.d_model
    full = sum(t.numel() for t in _shape_model(cfg, 1).parameters())
    per_rank = sum(t.numel() for t in _shape_model(cfg, p.tp).parameters())
    params = full - pad_rows
    # Memory per rank: weights and gradients in the training precision, fp32 Adam state
    # (master weights, m, v) sharded over DP by ZeRO >= 1, gradients by ZeRO >= 2.
    w = BYTES[cfg.train.precision]
    zero = cfg.train.zero_stage
    weights = per_rank * w
    grads = per_rank * w / (dp if zero >= 2 else 1)
    master = 0 if cfg.train.precision == "fp32" else per_rank * 4
    optimizer = (per_rank * 8 + master) / (dp if zero >= 1 else 1)
    # Activations of one micro-batch (Korthikanti et al. 2022, per layer, 2-byte
    # activations): s b h (10 + 24/t + 5 a s / (h t)), or s b h / t (34 + 5 a s / h) with
    # sequence parallelism; a decoder layer (two attentions) is counted as 1.5 layers.
    s = cfg.data.max_len
    b = max(1, cfg.data.max_tokens // s)
    h, a, t = m.d_model, m.num_heads, p.tp
    per_layer = s * b * h * ((34 + 5 * a * s / h) / t if p.sequence_parallel else 10 + 24 / t + 5 * a * s / (h * t))
    per_layer *= w / 2
    if m.activation_checkpointing:  # only the layer inputs are kept
        per_layer = s * b * h * w / (t if p.sequence_parallel else 1)
    activations = per_layer * (m.encoder_layers + 1.5 * m.decoder_layers)
    return {
        "parameters": params,
        "parameters_per_rank": per_rank,
        "padded_vocab_size": padded,
        "vocab_padding_parameters": pad_rows,
        "flops_per_token": 6 * params,
        "memory_per_rank_bytes": {
            "weights": int(weights),
            "gradients": int(grads),
            "optimizer": int(optimizer),
            "activations": int(activations),
            "total": int(weights + grads + optimizer + activations),
        },
        "layout": {
            "tp": p.tp,
            "dp": dp,
            "zero_stage": zero,
            "precision": cfg.train.precision,
            "sequence_parallel": p.sequence_parallel,
        },
    }


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=existing_file, required=True, help="YAML config, e.g. configs/transformer_big.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def main(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    info = model_info(cfg)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    mem = info["memory_per_rank_bytes"]
    lay = info["layout"]
    print(f"config            {args.config}")
    print(
        f"parameters        {info['parameters']:,} ({info['parameters'] / 1e6:.1f}M; vocabulary "
        f"{cfg.data.vocab_size} padded to {info['padded_vocab_size']}, +{info['vocab_padding_parameters']:,} padding)"
    )
    print(f"per TP rank       {info['parameters_per_rank']:,} (tp={lay['tp']})")
    print(f"FLOPs per token   {info['flops_per_token'] / 1e9:.3f} GFLOP (training, 6 x parameters per target token)")
    print(
        f"memory per rank   {_gib(mem['total'])}: weights {_gib(mem['weights'])}, gradients {_gib(mem['gradients'])}, "
        f"optimizer {_gib(mem['optimizer'])} (ZeRO-{lay['zero_stage']} over dp={lay['dp']}), "
        f"activations ~{_gib(mem['activations'])} ({cfg.data.max_tokens} tokens x max_len {cfg.data.max_len}, estimate)"
    )
    return 0
