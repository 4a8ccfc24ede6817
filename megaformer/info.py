"""Parameters, FLOPs, memory, the optimizer step and the cost of a layout (what ``megaformer info`` prints).

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

import dataclasses

from megaformer.config import Config, ParallelConfig
from megaformer.data.batching import plan_step
from megaformer.errors import ConfigError
from megaformer.layout_cost import Hardware, step_cost
from megaformer.model.shape import shape_model
from megaformer.parallel import check_model_split, padded_vocab_size
from megaformer.parallel.stages import COPY, OWN, StagePart, bubble_fraction, plan_stages

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def model_info(cfg: Config, micro_tokens: int = 0) -> dict:
    """Parameter counts, training FLOPs per target token and a per-rank memory estimate.

    Activations are those of one micro-batch of ``micro_tokens`` tokens (0: ``data.max_tokens``,
    the largest a micro-batch may be; the step's plan gives the size at a DP size).
    """
    m, p = cfg.model, cfg.parallel
    check_model_split(m, p.tp)
    dp = max(1, p.dp)
    padded = padded_vocab_size(cfg.data.vocab_size, p.tp, p.vocab_multiple)
    pad_rows = (padded - cfg.data.vocab_size) * m.d_model
    full, per_rank = parameter_count(cfg, 1), parameter_count(cfg, p.tp)
    params = full - _padding_rows(cfg, 1)  # the TP=1 model's padding, which can differ from the configured tp's
    state = _state_bytes(cfg, per_rank, dp)
    activations = _layer_activation_bytes(cfg, micro_tokens) * (m.encoder_layers + 1.5 * m.decoder_layers)
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


def _layer_activation_bytes(cfg: Config, micro_tokens: int = 0) -> float:
    """Activations one encoder layer keeps for backward, for one micro-batch of ``micro_tokens`` (or ``data.max_tokens``).

    Korthikanti et al. 2022, per layer, 2-byte activations: s b h (10 + 24/t + 5 a s / (h t)),
    or s b h / t (34 + 5 a s / h) with sequence parallelism; a decoder layer (two
    attentions) is counted as 1.5 layers by the callers.
    """
    m, p = cfg.model, cfg.parallel
    w = BYTES[cfg.train.precision]
    s = cfg.data.max_len
    b = max(1, (micro_tokens or cfg.data.max_tokens) // s)
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


def pipeline_info(cfg: Config, micro_batches: int, micro_tokens: int = 0) -> dict:
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
    per_layer, w, dp = _layer_activation_bytes(cfg, micro_tokens), BYTES[cfg.train.precision], max(1, p.dp)
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
        try:
            step = step_info(alt, world // tp)
        except ConfigError as err:
            step = {"refused": str(err)}
        info = model_info(alt, step.get("max_tokens_per_micro_batch", 0))
        row = step_cost(
            m, info["parameters"], info["parameters_per_rank"], cfg.train.tokens_per_step, tp, world // tp,
            cfg.train.precision, hw,
        )  # fmt: skip
        row["memory_per_rank_bytes"] = info["memory_per_rank_bytes"]["total"]
        row.update(step)
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


def config_info(cfg: Config, world: int = 0, hw: Hardware = Hardware()) -> dict:
    """Everything ``megaformer info`` reports about ``cfg``, as one dict (what ``--json`` prints).

    :func:`model_info`, the optimizer step (:func:`step_info`), with ``parallel.pp > 1``
    the stages (:func:`pipeline_info`), and the estimate of every TP size for ``world``
    GPUs (default: tp x dp x pp, or 32 if ``parallel.dp`` is 0) on ``hw``. A ``world`` given
    with ``parallel.dp`` 0 sets the DP size of the memory and step lines, as the launcher would;
    where the configured layout cannot run on ``world`` GPUs, they are the config's own and
    ``refused_on_world`` says why.
    """
    p, on_world = cfg.parallel, None
    if world:  # the memory and step lines at --world's DP size, as the launcher would run the config
        try:
            on_world = _configured(dataclasses.replace(cfg, parallel=dataclasses.replace(p, dp=_dp_of_world(p, world))))
        except ConfigError as err:
            refused = str(err)
    info = on_world or {**_configured(cfg), **({"refused_on_world": refused} if world else {})}
    world = world or (p.tp * p.dp * p.pp if p.dp else 32)
    info["layouts"] = {"world": world, "hardware": dataclasses.asdict(hw), "estimates": compare_layouts(cfg, world, hw)}
    return info


def _configured(cfg: Config) -> dict:
    """Model, memory, step (and stages) of ``cfg``'s own layout; ConfigError if its step is refused."""
    step = step_info(cfg, max(1, cfg.parallel.dp))
    info = {**model_info(cfg, step["max_tokens_per_micro_batch"]), **step}
    if cfg.parallel.pp > 1:
        info["pipeline"] = pipeline_info(cfg, step["micro_batches_per_step"], step["max_tokens_per_micro_batch"])
    return info


def _dp_of_world(p: ParallelConfig, world: int) -> int:
    """The DP size of ``p``'s layout on ``world`` GPUs; ConfigError if that layout cannot fill them."""
    ranks = p.tp * p.pp
    layout = f"parallel.tp={p.tp} x parallel.pp={p.pp}" + (f" x parallel.dp={p.dp}" if p.dp else "")
    if world % ranks or (p.dp and p.dp * ranks != world):
        needs = f"runs on {p.dp * ranks} GPUs" if p.dp else f"needs {ranks} GPUs a replica, which do not divide {world}"
        raise ConfigError(f"the configured layout ({layout}) {needs}; with parallel.dp=0 the DP size follows the GPUs")
    return world // ranks
