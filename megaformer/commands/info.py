"""``megaformer info``: parameters, FLOPs, memory, the optimizer step and the cost of a layout.

Prints :func:`megaformer.info.config_info` of ``--config`` (with ``--set`` overrides) as
aligned lines, or as one JSON object with ``--json``; ``--world`` and the hardware options
say which machine the layouts are compared for (:mod:`megaformer.layout_cost`).
"""

from __future__ import annotations

import argparse
import json

from megaformer.cli_args import existing_file, finite_float, positive_int
from megaformer.config import Config, load_config
from megaformer.info import config_info, fastest
from megaformer.layout_cost import Hardware


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=existing_file, required=True, help="YAML config, e.g. configs/transformer_big.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--world",
        type=positive_int,
        default=None,
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
    hw = Hardware(gpus_per_node=args.gpus_per_node, nvlink_gbs=args.nvlink_gbs, nic_gbs=args.nic_gbs)
    info = config_info(cfg, args.world or 0, hw)  # 0: the config's world
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    _print_model(info, cfg, args.config)
    if "refused_on_world" in info:
        print(f"on {args.world} GPUs{'':<{max(1, 10 - len(str(args.world)))}}refused: {info['refused_on_world']}")
    if "pipeline" in info:
        _print_pipeline(info["pipeline"])
    _print_layouts(info["layouts"], cfg)
    return 0


def _print_model(info: dict, cfg: Config, config: str) -> None:
    mem, lay, n = info["memory_per_rank_bytes"], info["layout"], info["micro_batches_per_step"]
    print(f"config            {config}")
    print(
        f"parameters        {info['parameters']:,} ({info['parameters'] / 1e6:.1f}M; vocabulary "
        f"{cfg.data.vocab_size} padded to {info['padded_vocab_size']}, +{info['vocab_padding_parameters']:,} padding)"
    )
    whole = f"; the whole model, pp={lay['pp']} splits it as below" if lay["pp"] > 1 else ""
    padding = ", its share of the padding rows included" if info["vocab_padding_parameters"] else ""
    stages = f" pp={lay['pp']}" if lay["pp"] > 1 else ""
    print(f"per TP rank       {info['parameters_per_rank']:,} (tp={lay['tp']}{padding}{whole})")
    print(f"FLOPs per token   {info['flops_per_token'] / 1e9:.3f} GFLOP (training, 6 x parameters per target token)")
    print(
        f"memory per rank   {_gib(mem['total'])}: weights {_gib(mem['weights'])}, gradients {_gib(mem['gradients'])}, "
        f"optimizer {_gib(mem['optimizer'])} (ZeRO-{lay['zero_stage']} over dp={lay['dp']}), "
        f"activations ~{_gib(mem['activations'])} (micro-batches of {info['max_tokens_per_micro_batch']} tokens, "
        f"max_len {cfg.data.max_len}, estimate"
        f"{'; the whole model on one rank, as at pp=1' if lay['pp'] > 1 else ''})"
    )
    print(
        f"optimizer step    {n} micro-batch{'es' * (n != 1)} of <= {info['max_tokens_per_micro_batch']} "
        f"tokens per DP rank, {info['tokens_per_step']:,} tokens per step at dp={lay['dp']}"
        f"{stages} (train.tokens_per_step={cfg.train.tokens_per_step})"
    )


def _print_pipeline(pipe: dict) -> None:
    p, m = pipe["pp"], pipe["micro_batches_per_step"]
    print(
        f"pipeline          pp={p} (parallel.pp_split={pipe['pp_split']}), 1F1B over {m} micro-batch{'es' * (m != 1)} per step: "
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
        configured = r["tp"] == cfg.parallel.tp and cfg.parallel.dp in (0, r["dp"]) and cfg.parallel.pp == 1
        mark = " <- fastest" if r is best else (" <- configured" if configured else "")
        print(
            f"{r['tp']:>3} {r['dp']:>4} {ms(1e3 * r['compute_s'])} {r['tp_bytes'] / 1e9:8.2f}GB {ms(1e3 * r['tp_s'])} "
            f"{r['dp_nvlink_bytes'] / 1e9:8.2f}GB {r['dp_nic_bytes'] / 1e9:7.2f}GB {ms(1e3 * r['dp_s'])} "
            f"{ms(1e3 * r['step_s'])} {micro:>12} {_gib(r['memory_per_rank_bytes']):>10}{mark}"
        )
    for r in layouts["estimates"]:  # why, once per reason
        if "refused" in r:
            print(f"refused at tp={r['tp']} dp={r['dp']}: {r['refused']}")
