"""The layouts of a cluster for a config: every one the trainer accepts, priced, the fastest marked.

A layout is (tp, pp, dp, ZeRO stage, activation checkpointing, micro-batch tokens) with
``tp x pp x dp`` the cluster's GPUs. It is proposed only if the project's own checks accept it
(:func:`megaformer.config.validate`, :func:`check_precision`, the layout arithmetic, the model split,
the pipeline cut) and its TP group lies inside a node. Micro-batches hold sentences of ``length``
tokens a side (27: WMT'14 en-de's mean in pieces); their sizes are ``data.max_tokens`` halved, at
most a rank's share of the step, the largest three (four with a pipeline). Activation
checkpointing only adds time, so it is tried where a layout does not fit without it. Traces
(:mod:`megaformer.plan.trace`) are made once per (tp, checkpointing, micro-batch) and every other
choice is priced from them (:mod:`megaformer.plan.price`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megaformer.config import Config, check_precision, validate
from megaformer.errors import ConfigError
from megaformer.parallel.layout import ParallelLayout, check_model_split
from megaformer.parallel.stages import plan_stages
from megaformer.plan.deepspeed import engine_share
from megaformer.plan.price import Cluster, Piece, checkpointed, pieces, ring_seconds, stage_piece, tp_seconds
from megaformer.plan.trace import trace_layers
from megaformer.sim.deepspeed import fake_world
from megaformer.sim.step import MicroShape

GIB = 2**30
ACT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    zero: int
    checkpointing: bool
    micro_tokens: int

    def config(self, cfg: Config) -> Config:
        """``cfg`` set to this layout (what ``--set`` would give ``megaformer train``)."""
        return dataclasses.replace(
            cfg,
            model=dataclasses.replace(cfg.model, activation_checkpointing=self.checkpointing),
            parallel=dataclasses.replace(cfg.parallel, tp=self.tp, pp=self.pp, dp=self.dp, pp_split=""),
            data=dataclasses.replace(cfg.data, max_tokens=self.micro_tokens),
            train=dataclasses.replace(cfg.train, zero_stage=self.zero),
        )

    def overrides(self, cfg: Config) -> list[str]:
        """The ``--set`` values that give ``cfg`` this layout (``parallel.dp`` checks the world size at launch;
        a stage cut of ``cfg`` cleared, the plan's stages being balanced by cost)."""
        sets = [
            f"parallel.tp={self.tp}",
            f"parallel.pp={self.pp}",
            f"parallel.dp={self.dp}",
            f"train.zero_stage={self.zero}",
            f"model.activation_checkpointing={str(self.checkpointing).lower()}",
            f"data.max_tokens={self.micro_tokens}",
        ]
        return sets + (["parallel.pp_split="] if cfg.parallel.pp_split else [])


def refusal(cfg: Config, layout: Layout, world: int, gpus_per_node: int) -> str | None:
    """Why the trainer would refuse ``layout`` (None: it accepts it)."""
    if gpus_per_node % layout.tp:
        return f"tp={layout.tp} would put a TP group across nodes of {gpus_per_node} GPUs"
    try:
        c = layout.config(cfg)
        validate(c)
        check_precision(c.train)
        ParallelLayout.from_config(c.parallel, world)
        check_model_split(c.model, layout.tp)
        plan_stages(c.model, layout.pp, "", c.data.vocab_size)
    except ConfigError as err:
        return str(err)
    return None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def micro_sizes(cfg: Config, dp: int, pp: int, length: int) -> list[int]:
    """Micro-batch tokens to try: ``data.max_tokens`` halved, no more than a rank's share of the step."""
    share = cfg.train.tokens_per_step / dp
    ladder = [cfg.data.max_tokens >> i for i in range(12) if cfg.data.max_tokens >> i >= length]
    fitting = [t for t in ladder if t <= share * 1.1] or ladder[-1:]
    return fitting[: 4 if pp > 1 else 3]


def candidates(cfg: Config, cluster: Cluster, length: int) -> list[Layout]:
    world, m = cluster.world, cfg.model
    out = []
    for tp in [t for t in _divisors(math.gcd(m.num_heads, m.d_ff)) if t <= cluster.gpus_per_node]:
        for pp in (
            [p for p in _divisors(world // tp) if p <= m.encoder_layers + m.decoder_layers] if world % tp == 0 else []
        ):
            dp = world // (tp * pp)
            for zero in (0, 1, 2):
                for tokens in micro_sizes(cfg, dp, pp, length):
                    out.append(Layout(tp, pp, dp, zero, False, tokens))
    return out


def _steps(cfg: Config, layout: Layout, length: int) -> tuple[MicroShape, int, int]:
    """The traced micro-batch, micro-batches per rank and target tokens per step of ``layout``."""
    shape = MicroShape(max(1, layout.micro_tokens // length), length, length)
    m = max(1, round(cfg.train.tokens_per_step / (layout.dp * shape.target_tokens)))
    return shape, m, m * layout.dp * shape.target_tokens


def price(cfg: Config, layout: Layout, cluster: Cluster, parts: tuple[Piece, Piece, Piece], length: int) -> dict:
    """Memory per GPU (the stage that needs most) and step time of ``layout`` (see :mod:`megaformer.plan.price`)."""
    rest, enc, dec = parts
    shape, m, tokens = _steps(cfg, layout, length)
    stages = plan_stages(cfg.model, layout.pp, "", cfg.data.vocab_size)
    t = cfg.train
    memory, slowest, busy, dp_s, opt_s = 0.0, 0.0, 0.0, 0.0, 0.0
    node_ranks = layout.tp * layout.dp
    for s, part in enumerate(stages):
        p = stage_piece(rest, enc, dec, len(part.encoder), len(part.decoder), part.first, part.last)
        share = engine_share(
            t.precision, layout.zero, int(p.params), layout.dp, m, t.zero_bucket_size, layout.tp, layout.pp
        )
        in_flight = min(layout.pp - s, m)
        kept = share.grads if m > 1 else 0
        own = max(p.peak, p.grads + share.transient)  # the backward's peak, or the reduction after it
        memory = max(memory, p.weights + share.state + kept + (in_flight - 1) * p.activations + own)
        stage_s = p.seconds + tp_seconds(p, layout.tp, cluster)
        if stage_s > slowest:
            slowest, busy = stage_s, p.device
        dp_bps = cluster.intra_bps if node_ranks <= cluster.gpus_per_node else cluster.inter_bps
        calls = [c for c in share.collectives if c.group == "dp"]
        if layout.zero == 2 and m > 1:  # the earlier micro-batches' reductions overlap the next one's work
            calls = calls[len(calls) * (m - 1) // m :]
        dp_s = max(dp_s, sum(ring_seconds(c, layout.dp, dp_bps, cluster.latency_s) for c in calls))
        shard = p.params / (layout.dp if layout.zero else 1)
        opt_s = max(opt_s, 2 * 16 * shard / (cluster.device.bandwidth * cluster.device.memory_efficiency))
    p2p_bytes = 2 * 2 * shape.sentences * length * cfg.model.d_model * ACT_BYTES[t.precision]
    p2p_bps = cluster.inter_bps if node_ranks >= cluster.gpus_per_node else cluster.intra_bps
    p2p_s = 0.0 if layout.pp == 1 else 2 * (cluster.latency_s + p2p_bytes / p2p_bps)
    compute_s = (m + layout.pp - 1) * (slowest + p2p_s)
    step_s = compute_s + dp_s + opt_s
    return {
        "tp": layout.tp,
        "pp": layout.pp,
        "dp": layout.dp,
        "zero": layout.zero,
        "activation_checkpointing": layout.checkpointing,
        "micro_tokens": layout.micro_tokens,
        "micro_batches": m,
        "tokens_per_step": tokens,
        "memory_gib": round(memory / GIB, 3),
        "step_ms": round(step_s * 1e3, 3),
        "compute_ms": round(compute_s * 1e3, 3),
        "device_ms": round(m * busy * 1e3, 3),  # of compute_ms, a GPU of the slowest stage busy
        "dp_ms": round(dp_s * 1e3, 3),
        "optimizer_ms": round(opt_s * 1e3, 3),
        "tokens_per_s": round(tokens / step_s),
        "fits": memory <= cluster.usable * cluster.memory_bytes,
    }


def search(cfg: Config, cluster: Cluster, length: int = 27) -> dict:
    """Every accepted layout of ``cfg`` on ``cluster`` priced; ``fastest`` the quickest of those that fit."""
    if cluster.world < 1:
        raise ConfigError("the cluster has no GPUs: give --nodes and --gpus-per-node of at least 1")
    rows, refused, cache = [], {}, {}
    with fake_world(cluster.world):
        for layout in candidates(cfg, cluster, length):
            why = refusal(cfg, layout, cluster.world, cluster.gpus_per_node)
            if why is not None:
                refused.setdefault(why, []).append(f"tp={layout.tp} pp={layout.pp} zero={layout.zero}")
                continue
            row = _priced(cfg, layout, cluster, length, cache)
            if not row["fits"]:
                checkpointed = dataclasses.replace(layout, checkpointing=True)
                rows.append(row | {"reason": _too_big(row, cluster)})
                row = _priced(cfg, checkpointed, cluster, length, cache)
                layout = checkpointed
            rows.append(row if row["fits"] else row | {"reason": _too_big(row, cluster)})
            rows[-1]["overrides"] = layout.overrides(cfg)
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        least = min(rows, key=lambda r: r["memory_gib"], default=None)
        if least is None:
            raise ConfigError(f"no layout of {cluster.world} GPUs is accepted: {next(iter(refused), '')}")
        raise ConfigError(
            f"no layout fits {cluster.world} GPUs of {cluster.memory_bytes / GIB:.0f} GiB: the smallest needs "
            f"{least['memory_gib']:.1f} GiB a GPU ({_name(least)}): add GPUs or nodes, or shrink the model"
        )
    fastest = min(fitting, key=lambda r: r["step_ms"])
    fastest["fastest"] = True
    return {"layouts": rows, "fastest": fastest, "refused": {k: v[:4] for k, v in refused.items()}}


def _priced(cfg: Config, layout: Layout, cluster: Cluster, length: int, cache: dict) -> dict:
    key = (layout.tp, layout.checkpointing, layout.micro_tokens)
    if key not in cache:
        shape, _, _ = _steps(cfg, layout, length)
        traces = trace_layers(layout.config(cfg), cluster.world, layout.tp, False, shape, "meta")
        cache[key] = pieces(traces, cluster.device)
        if layout.checkpointing:
            layer_input = shape.target_tokens * cfg.model.d_model * ACT_BYTES[cfg.train.precision]
            cache[key] = checkpointed(cache[key], layer_input)
    return price(layout.config(cfg), layout, cluster, cache[key], length)


def _too_big(row: dict, cluster: Cluster) -> str:
    return (
        f"needs {row['memory_gib']:.1f} GiB a GPU, {cluster.usable:.0%} of {cluster.memory_bytes / GIB:.0f} GiB usable"
    )


def _name(row: dict) -> str:
    return (
        f"tp={row['tp']} pp={row['pp']} dp={row['dp']} zero={row['zero']} "
        f"checkpointing={'on' if row['activation_checkpointing'] else 'off'} micro-batch {row['micro_tokens']} tokens"
    )
