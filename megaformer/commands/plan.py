"""``megaformer plan``: the layouts of a config on a cluster, their memory per GPU and step time, the fastest.

Every layout the trainer accepts (tp, pp, dp, ZeRO stage, activation checkpointing, micro-batch
tokens) is priced from the real code traced in a fake world of the cluster's size
(:mod:`megaformer.plan`). Defaults: H100 and H200 SXM, NVLink 4 at 450 GB/s a direction, one
400 Gb/s NIC a GPU (50 GB/s); 80 GB and 141 GB of memory, 90 % of it usable.
"""

from __future__ import annotations

import argparse
import json

from megaformer.cli_args import existing_file, finite_float, positive_int
from megaformer.config import load_config

GPU_MEMORY_GB = {"h100": 80.0, "h200": 141.0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=existing_file, required=True, help="YAML config, e.g. configs/transformer_big.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs a node (default 8)")
    p.add_argument("--gpu", choices=sorted(GPU_MEMORY_GB), default="h100", help="GPU kind (default h100)")
    p.add_argument("--gpu-memory-gb", type=finite_float(0, lo_open=True), default=None, help="memory a GPU")
    p.add_argument("--nvlink-gbs", type=finite_float(0, lo_open=True), default=450.0, help="GB/s inside a node")
    p.add_argument("--network-gbs", type=finite_float(0, lo_open=True), default=50.0, help="GB/s a GPU between nodes")
    p.add_argument("--length", type=positive_int, default=27, help="tokens a sentence a side (default 27)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=positive_int, default=None, help="steps to train (default train.max_steps)")
    budget.add_argument("--tokens", type=positive_int, default=None, help="target tokens to train")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def main(args: argparse.Namespace) -> int:
    from megaformer.errors import ConfigError
    from megaformer.plan.price import Cluster
    from megaformer.plan.search import search
    from megaformer.sim.roofline import GPUS

    for name in ("nodes", "gpus_per_node"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag}={getattr(args, name)}: a cluster needs at least one; give {flag} 1 or more")
    cfg = load_config(args.config, args.overrides)
    memory = (args.gpu_memory_gb or GPU_MEMORY_GB[args.gpu]) * 1e9
    cluster = Cluster(
        args.nodes, args.gpus_per_node, GPUS[args.gpu], memory, args.nvlink_gbs * 1e9, args.network_gbs * 1e9
    )
    result = search(cfg, cluster, args.length)
    best = result["fastest"]
    steps = args.steps or (None if args.tokens else cfg.train.max_steps)
    tokens = args.tokens or steps * cfg.train.tokens_per_step
    hours = tokens / best["tokens_per_s"] / 3600
    result["cluster"] = {
        "nodes": args.nodes,
        "gpus_per_node": args.gpus_per_node,
        "gpu": args.gpu,
        "gpu_memory_gb": memory / 1e9,
        "nvlink_gbs": args.nvlink_gbs,
        "network_gbs": args.network_gbs,
    }
    result["budget"] = {"tokens": tokens, "hours_at_fastest": round(hours, 2)}
    result["overrides"] = [
        f"parallel.tp={best['tp']}", f"parallel.pp={best['pp']}", f"parallel.dp={best['dp']}",
        f"train.zero_stage={best['zero']}", f"model.activation_checkpointing={str(best['activation_checkpointing']).lower()}",
        f"data.max_tokens={best['micro_tokens']}",
    ]  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    _print(result)
    return 0


def _print(result: dict) -> None:
    c = result["cluster"]
    print(
        f"{c['nodes']} x {c['gpus_per_node']} {c['gpu'].upper()} ({c['gpu_memory_gb']:.0f} GB, NVLink {c['nvlink_gbs']:.0f}"
        f" GB/s, network {c['network_gbs']:.0f} GB/s a GPU); TP collectives and transfers between stages are not"
        f" overlapped, ZeRO-2's reductions of all but the last micro-batch are"
    )
    print(
        f"{'tp':>3} {'pp':>3} {'dp':>4} {'zero':>4} {'ckpt':>4} {'micro':>6} {'m':>3} {'GiB':>7} {'step ms':>9} {'tok/s':>10}"
    )
    for r in sorted(result["layouts"], key=lambda r: (not r["fits"], r["step_ms"])):
        mark = "  <- fastest" if r.get("fastest") else (f"  does not fit: {r['reason']}" if not r["fits"] else "")
        print(
            f"{r['tp']:>3} {r['pp']:>3} {r['dp']:>4} {r['zero']:>4} {'on' if r['activation_checkpointing'] else 'off':>4}"
            f" {r['micro_tokens']:>6} {r['micro_batches']:>3} {r['memory_gib']:>7.2f} {r['step_ms']:>9.1f}"
            f" {r['tokens_per_s']:>10,}{mark}"
        )
    b = result["budget"]
    print(
        f"{b['tokens']:,} tokens at the fastest: {b['hours_at_fastest']:.1f} h; train with --set {' --set '.join(result['overrides'])}"
    )
