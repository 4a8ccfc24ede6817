"""``megaformer info``: parameters, FLOPs, memory, the optimizer step and the cost of a layout.

Counts come from the model itself, built on the ``meta`` device (no memory, no
initialisation), at TP=1 and at the configured TP size; the vocabulary padding rows
are reported apart and excluded from ``parameters``. The step (micro-batches and their
size) is :func:`megaformer.data.batching.plan_step` for the layout given; the layout
estimate (compute vs TP and DP communication per step) is :mod:`megaformer.layout_cost`.

With ``parallel.pp > 1`` each pipeline stage (:func:`megaformer.parallel.stages.plan_stages`)
is built on the meta device too: its parameters, the layers it holds, its memory
(1F1B keeps up to ``min(pp - i, m)`` micro-batches' activations in flight on stage
``i``) and the step's bubble ``(p - 1) / (m + p - 1)`` for ``m`` micro-batches per rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from megaformer.cli_args import existing_file, finite_float, nonneg_int, positive_int
from megaformer.config import Config, load_config
from megaformer.data.batching import plan_step
from megaformer.errors import ConfigError
from megaformer.layout_cost import Hardware, step_cost
from megaformer.model.shape import shape_model
from megaformer.parallel import check_model_split, padded_vocab_size
from megaformer.parallel.stages import COPY, OWN, StagePart, bubble_fraction, plan_stages

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def model_info(cfg: Config) -> dict:
    """Parameter counts, training FLOPs per target token and a per-rank memory estimate."""
    m, p = cfg.model, cfg.parallel
    check_model_split(m, p.tp)
    dp = max(1, p.dp)
    padded = padded_vocab_size(cfg.data.vocab_size, p.tp, p.vocab_multiple)
    pad_rows = (padded - cfg.data.vocab_size) * m.d_model
    full, per_rank = parameter_count(cfg, 1), parameter_count(cfg, p.tp)
    params = full - _padding_rows(cfg, 1)  # the TP=1 model's padding, which can differ from the configured tp's
    state = _state_bytes(cfg, per_rank, dp)
    activations = _layer_activation_bytes(cfg) * (m.encoder_layers + 1.5 * m.decoder_layers)
    return {
        "parameters": params,
        "parameters_per_rank": per_rank,
        "padded_vocab_size": padded,
        "vocab_padding_parameters": pad_rows,
        "flops_per_token": 6 * params,
        "memory_per_rank_bytes": {
            **{k: int(v) for k, v in state.items()},
            "activations": int(activations),
            "total": int(sum(state.values()) + activations),
        },
        "layout": {
            "tp": p.tp,
            "dp": dp,
            "pp": p.pp,
            "zero_stage": cfg.train.zero_stage,
            "precision": cfg.train.precision,
            "sequence_parallel": p.sequence_parallel,
        },
    }


def parameter_count(cfg: Config, tp_size: int) -> int:
    """Parameters of the whole model on one rank of ``tp_size``, padding rows included.

    The count is affine in the layer counts (embedding and final norms, plus E encoder
    layers, plus D decoder layers), so three small models on the meta device give it for
    any depth: a 4,000-layer model is not built four times over by ``info``.
    """

    def count(encoder: int, decoder: int) -> int:
        small = dataclasses.replace(cfg.model, encoder_layers=encoder, decoder_layers=decoder)
        model = shape_model(dataclasses.replace(cfg, model=small), cfg.data.vocab_size, tp_size)
        return sum(t.numel() for t in model.parameters())

    base = count(1, 1)
    encoder_layer, decoder_layer = count(2, 1) - base, count(1, 2) - base
    return base + (cfg.model.encoder_layers - 1) * encoder_layer + (cfg.model.decoder_layers - 1) * decoder_layer


def _padding_rows(cfg: Config, tp: int) -> int:
    """Vocabulary padding parameters of the embedding at TP size ``tp`` (all ranks together)."""
    padded = padded_vocab_size(cfg.data.vocab_size, tp, cfg.parallel.vocab_multiple)
    return (padded - cfg.data.vocab_size) * cfg.model.d_model


def _state_bytes(cfg: Config, per_rank: int, dp: int) -> dict[str, float]:
    """Weights, gradients and optimizer state of ``per_rank`` parameters on one rank.

    Weights and gradients in the training precision, fp32 Adam state (master weights,
    m, v) sharded over DP by ZeRO >= 1, gradients by ZeRO >= 2.
    """
    w, zero = BYTES[cfg.train.precision], cfg.train.zero_stage
    master = 0 if cfg.train.precision == "fp32" else per_rank * 4
    return {
        "weights": per_rank * w,
        "gradients": per_rank * w / (dp if zero >= 2 else 1),
        "optimizer": (per_rank * 8 + master) / (dp if zero >= 1 else 1),
    }


def _layer_activation_bytes(cfg: Config) -> float:
    """Activations one encoder layer keeps for backward, for one micro-batch.

    Korthikanti et al. 2022, per layer, 2-byte activations: s b h (10 + 24/t + 5 a s / (h t)),
    or s b h / t (34 + 5 a s / h) with sequence parallelism; a decoder layer (two
    attentions) is counted as 1.5 layers by the callers.
    """
    m, p = cfg.model, cfg.parallel
    w = BYTES[cfg.train.precision]
    s = cfg.data.max_len
    b = max(1, cfg.data.max_tokens // s)
    h, a, t = m.d_model, m.num_heads, p.tp
    if m.activation_checkpointing:  # only the layer inputs are kept
        return s * b * h * w / (t if p.sequence_parallel else 1)
    per_layer = s * b * h * ((34 + 5 * a * s / h) / t if p.sequence_parallel else 10 + 24 / t + 5 * a * s / (h * t))
    return per_layer * w / 2


def step_info(cfg: Config, dp: int) -> dict:
    """The optimizer step of a fresh run at ``dp`` DP ranks (one data stream each); ConfigError if refused."""
    plan = plan_step(cfg.train.tokens_per_step, dp, cfg.data.max_tokens, cfg.data.max_len + 1)
    return {
        "micro_batches_per_step": plan.micro_batches_per_rank(dp),
        "max_tokens_per_micro_batch": plan.max_tokens_per_micro_batch,
        "tokens_per_step": plan.tokens_per_step,
    }


def _stage_counts(cfg: Config, part: StagePart, tp_size: int, known: dict) -> tuple[int, int]:
    """(parameters, embedding-copy elements) of one stage at TP size ``tp_size``; the copy is a buffer.

    Stages alike in what decides their parameters (layer counts, embedding, final norms)
    are built once: ``known`` holds the counts of the stages seen so far.
    """
    key = (tp_size, len(part.encoder), len(part.decoder), part.embedding, part.ends_encoder, part.last)
    if key not in known:
        model = shape_model(cfg, cfg.data.vocab_size, tp_size, part)
        copy = model.embed.weight.numel() if part.embedding == COPY else 0
        known[key] = sum(t.numel() for t in model.parameters()), copy
    return known[key]


def pipeline_info(cfg: Config, micro_batches: int) -> dict:
    """Per stage: layers, parameters, embedding copy and memory; the 1F1B bubble for ``micro_batches`` per rank.

    ``parameters`` of a stage are counted at TP=1 without the vocabulary padding rows
    (which the embedding's owner, stage 0, holds), so that they sum to the model's. A
    copy of the embedding (the stage that starts the decoder, the last stage) is a buffer
    with a gradient in the training precision and an fp32 sum over the step's
    micro-batches, and no optimizer state.
    """
    p = cfg.parallel
    parts = plan_stages(cfg.model, p.pp, p.pp_split, cfg.data.vocab_size)
    pad_rows = _padding_rows(cfg, 1)
    per_layer, w, dp = _layer_activation_bytes(cfg), BYTES[cfg.train.precision], max(1, p.dp)
    stages, known = [], {}
    for part in parts:
        full, _ = _stage_counts(cfg, part, 1, known)
        per_rank, copy = _stage_counts(cfg, part, p.tp, known)
        in_flight = min(p.pp - part.index, micro_batches)
        mem = _state_bytes(cfg, per_rank, dp)
        mem["weights"] += copy * w
        mem["gradients"] += copy * (w + 4)
        mem["activations"] = per_layer * (len(part.encoder) + 1.5 * len(part.decoder)) * in_flight
        stages.append(
            {
                "stage": part.index,
                "layers": part.describe(),
                "embedding": part.embedding,
                "parameters": full - (pad_rows if part.embedding == OWN else 0),
                "parameters_per_rank": per_rank,
                "embedding_copy": copy,
                "micro_batches_in_flight": in_flight,
                "memory_per_rank_bytes": {**{k: int(v) for k, v in mem.items()}, "total": int(sum(mem.values()))},
            }
        )
    return {
        "pp": p.pp,
        "pp_split": p.pp_split or "balanced",
        "micro_batches_per_step": micro_batches,
        "bubble_fraction": bubble_fraction(p.pp, micro_batches),
        "stages": stages,
    }


def compare_layouts(cfg: Config, world: int, hw: Hardware = Hardware()) -> list[dict]:
    """The step estimate of every TP size that fits one node and divides heads, d_ff and ``world``."""
    out = []
    for tp in range(1, hw.gpus_per_node + 1):
        m = cfg.model
        if world % tp or m.num_heads % tp or m.d_ff % tp:
            continue
        alt = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp=tp, dp=world // tp))
        info = model_info(alt)
        row = step_cost(
            m, info["parameters"], info["parameters_per_rank"], cfg.train.tokens_per_step, tp, world // tp,
            cfg.train.precision, hw,
        )  # fmt: skip
        row["memory_per_rank_bytes"] = info["memory_per_rank_bytes"]["total"]
        try:
            row.update(step_info(alt, world // tp))
        except ConfigError as err:
            row["refused"] = str(err)
        out.append(row)
    return out


def fastest(estimates: list[dict], within: float = 0.02) -> dict | None:
    """The layout with the shortest estimated step; within 2 % of it, the one with larger micro-batches.

    The estimate ignores GEMM efficiency, which falls with smaller micro-batches: a tie
    goes to the layout whose GPUs see more tokens at once.
    """
    rows = [r for r in estimates if "refused" not in r]
    if not rows:
        return None
    shortest = min(r["step_s"] for r in rows)
    close = [r for r in rows if r["step_s"] <= shortest * (1 + within)]
    return max(close, key=lambda r: (r["max_tokens_per_micro_batch"] * r["micro_batches_per_step"], -r["step_s"]))


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=existing_file, required=True, help="YAML config, e.g. configs/transformer_big.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--world",
        type=nonneg_int,
        default=0,
        help="GPUs the layouts are compared for (default: tp x dp x pp, or 32 if dp=0)",
    )
    p.add_argument("--gpus-per-node", type=positive_int, default=Hardware.gpus_per_node)
    p.add_argument(
        "--nvlink-gbs",
        type=finite_float(0, lo_open=True),
        default=Hardware.nvlink_gbs,
        help="all-reduce GB/s inside a node",
    )
    p.add_argument(
        "--nic-gbs", type=finite_float(0, lo_open=True), default=Hardware.nic_gbs, help="inter-node GB/s per GPU"
    )


def main(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    info = model_info(cfg)
    dp = info["layout"]["dp"]
    info.update(step_info(cfg, dp))
    if cfg.parallel.pp > 1:
        info["pipeline"] = pipeline_info(cfg, info["micro_batches_per_step"])
    hw = Hardware(gpus_per_node=args.gpus_per_node, nvlink_gbs=args.nvlink_gbs, nic_gbs=args.nic_gbs)
    p = cfg.parallel
    world = args.world or (p.tp * p.dp * p.pp if p.dp else 32)
    info["layouts"] = {"world": world, "hardware": dataclasses.asdict(hw), "estimates": compare_layouts(cfg, world, hw)}
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
    whole = f"; the whole model, pp={lay['pp']} splits it as below" if lay["pp"] > 1 else ""
    stages = f" pp={lay['pp']}" if lay["pp"] > 1 else ""
    print(f"per TP rank       {info['parameters_per_rank']:,} (tp={lay['tp']}{whole})")
    print(f"FLOPs per token   {info['flops_per_token'] / 1e9:.3f} GFLOP (training, 6 x parameters per target token)")
    print(
        f"memory per rank   {_gib(mem['total'])}: weights {_gib(mem['weights'])}, gradients {_gib(mem['gradients'])}, "
        f"optimizer {_gib(mem['optimizer'])} (ZeRO-{lay['zero_stage']} over dp={lay['dp']}), "
        f"activations ~{_gib(mem['activations'])} ({cfg.data.max_tokens} tokens x max_len {cfg.data.max_len}, estimate"
        f"{'; the whole model on one rank, as at pp=1' if lay['pp'] > 1 else ''})"
    )
    print(
        f"optimizer step    {info['micro_batches_per_step']} micro-batches of <= {info['max_tokens_per_micro_batch']} "
        f"tokens per DP rank, {info['tokens_per_step']:,} tokens per step at dp={dp}"
        f"{stages} (train.tokens_per_step={cfg.train.tokens_per_step})"
    )
    if "pipeline" in info:
        _print_pipeline(info["pipeline"])
    _print_layouts(info["layouts"], cfg)
    return 0


def _print_pipeline(pipe: dict) -> None:
    p, m = pipe["pp"], pipe["micro_batches_per_step"]
    print(
        f"pipeline          pp={p} (parallel.pp_split={pipe['pp_split']}), 1F1B over {m} micro-batches per step: "
        f"bubble (p - 1) / (m + p - 1) = {p - 1}/{m + p - 1} = {pipe['bubble_fraction']:.1%} of the step idle"
    )
    for st in pipe["stages"]:
        mem = st["memory_per_rank_bytes"]
        role = {"own": ", owns the embedding", "copy": f", embedding copy {st['embedding_copy']:,} in a buffer"}
        n = st["micro_batches_in_flight"]
        print(
            f"stage {st['stage']:<11} {st['layers']}: {st['parameters']:,} parameters "
            f"({st['parameters_per_rank']:,} per TP rank{role.get(st['embedding'], '')}); memory per rank "
            f"{_gib(mem['total'])}: weights {_gib(mem['weights'])}, gradients {_gib(mem['gradients'])}, "
            f"optimizer {_gib(mem['optimizer'])}, activations ~{_gib(mem['activations'])} "
            f"({n} micro-batch{'es' if n > 1 else ''} in flight)"
        )
    print(f"{'':18}1F1B keeps up to min(pp - i, m) micro-batches' activations in flight on stage i")


def _print_layouts(layouts: dict, cfg: Config) -> None:
    hw = layouts["hardware"]
    print(
        f"\nlayouts for {layouts['world']} GPUs ({hw['gpus_per_node']} per node; compute at {hw['efficiency']:.0%} of "
        f"{hw['peak_tflops']:.0f} TFLOP/s, TP and intra-node DP at {hw['nvlink_gbs']:.0f} GB/s, inter-node DP at "
        f"{hw['nic_gbs']:.0f} GB/s per GPU; megaformer/layout_cost.py states the model"
        f"{'; TP x DP only, without pipeline stages' if cfg.parallel.pp > 1 else ''}):"
    )
    print(f"{'tp':>3} {'dp':>4} {'compute':>9} {'TP bytes':>10} {'TP':>8} {'DP NVLink':>10} {'DP NIC':>9} {'DP':>8}"
          f" {'step':>8} {'micro-batch':>12} {'memory':>10}")  # fmt: skip
    best = fastest(layouts["estimates"])
    for r in layouts["estimates"]:
        ms = "{:7.1f}ms".format
        micro = "refused" if "refused" in r else f"{r['micro_batches_per_step']} x {r['max_tokens_per_micro_batch']}"
        configured = r["tp"] == cfg.parallel.tp and cfg.parallel.pp == 1
        mark = " <- fastest" if r is best else (" <- configured" if configured else "")
        print(
            f"{r['tp']:>3} {r['dp']:>4} {ms(1e3 * r['compute_s'])} {r['tp_bytes'] / 1e9:8.2f}GB {ms(1e3 * r['tp_s'])} "
            f"{r['dp_nvlink_bytes'] / 1e9:8.2f}GB {r['dp_nic_bytes'] / 1e9:7.2f}GB {ms(1e3 * r['dp_s'])} "
            f"{ms(1e3 * r['step_s'])} {micro:>12} {_gib(r['memory_per_rank_bytes']):>10}{mark}"
        )
