"""``megaformer plan``: the layouts of a config on a cluster, their memory per GPU and step time, the fastest.

Every layout the trainer accepts (tp, pp, dp, ZeRO stage, activation checkpointing, micro-batch
tokens) is priced from the real code traced in a fake world of the cluster's size
(:mod:`megaformer.plan`). Defaults: H100 and H200 SXM, NVLink 4 at 450 GB/s a direction, one
400 Gb/s NIC a GPU (50 GB/s); 80 GB and 141 GB of memory, 90 % of it usable; the host of each GPU spends
20 us an operator beside a 5 us launch (the one H200 run measured, of 2026-11-30, is met at ~20 us: see
docs/results.md; a CPU like the development EPYC measures 3-14 us without CUDA's own host work), so an eager
step of many small operators is bounded below by its operators' count, however thinly it is split.
"""

from __future__ import annotations

import argparse
import json

from megaformer.cli_args import existing_file, finite_float, positive_int
from megaformer.config import load_config

GPU_MEMORY_GB = {"h100": 80.0, "h200": 141.0}
HOST_US = 20.0  # what the H200 run of 2026-11-30 needs beside the 5 us launch (docs/results.md)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=existing_file, required=True, help="YAML config, e.g. configs/transformer_big.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--nodes", type=positive_int, default=1, help="nodes (default 1)")
    p.add_argument("--gpus-per-node", type=positive_int, default=8, help="GPUs a node (default 8)")
    p.add_argument("--gpu", choices=sorted(GPU_MEMORY_GB), default="h100", help="GPU kind (default h100)")
    p.add_argument("--gpu-memory-gb", type=finite_float(0, lo_open=True), default=None, help="memory a GPU")
    p.add_argument("--nvlink-gbs", type=finite_float(0, lo_open=True), default=450.0, help="GB/s inside a node")
    p.add_argument("--network-gbs", type=finite_float(0, lo_open=True), default=50.0, help="GB/s a GPU between nodes")
    p.add_argument("--length", type=positive_int, default=27, help="tokens a sentence a side (default 27)")
    p.add_argument(
        "--host-us",
        type=finite_float(0),
        default=HOST_US,
        help=f"host time per operator on a GPU's host, beside the 5 us launch (default {HOST_US:g})",
    )
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=positive_int, default=None, help="steps to train (default train.max_steps)")
    budget.add_argument("--tokens", type=positive_int, default=None, help="target tokens to train")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def main(args: argparse.Namespace) -> int:
    from megaformer.plan.price import Cluster
    from megaformer.plan.search import search
    from megaformer.sim.roofline import GPUS

    cfg = load_config(args.config, args.overrides)
    memory = (args.gpu_memory_gb or GPU_MEMORY_GB[args.gpu]) * 1e9
    device = GPUS[args.gpu].with_host(args.host_us * 1e-6)
    cluster = Cluster(args.nodes, args.gpus_per_node, device, memory, args.nvlink_gbs * 1e9, args.network_gbs * 1e9)
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
        "host_us_per_op": args.host_us,
        "launch_us": device.launch_s * 1e6,
    }
    result["budget"] = {"tokens": tokens, "hours_at_fastest": round(hours, 2)}
    result["overrides"] = best["overrides"]
    sets = " ".join(f"--set {s}" for s in best["overrides"])
    result["command"] = f"sbatch --nodes={args.nodes} slurm/train_big.sh {sets} --set data.path=DATA"
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    _print(result)
    return 0


def _print(result: dict) -> None:
    c = result["cluster"]
    print(
        f"{c['nodes']} x {c['gpus_per_node']} {c['gpu'].upper()} ({c['gpu_memory_gb']:.0f} GB, NVLink {c['nvlink_gbs']:.0f}"
        f" GB/s, network {c['network_gbs']:.0f} GB/s a GPU); host {c['host_us_per_op']:g} us an operator + "
        f"{c['launch_us']:g} us a launch (--host-us); TP collectives and transfers between stages are not"
        f" overlapped, ZeRO-2's reductions of all but the last micro-batch are"
    )
    print(
        f"{'tp':>3} {'pp':>3} {'dp':>4} {'zero':>4} {'ckpt':>4} {'micro':>6} {'m':>3} {'GiB':>7} {'step ms':>9}"
        f" {'busy ms':>8} {'tok/s':>10}  --set"
    )
    for r in sorted(result["layouts"], key=lambda r: (not r["fits"], r["step_ms"])):
        mark = "  <- fastest" if r.get("fastest") else (f"  does not fit: {r['reason']}" if not r["fits"] else "")
        print(
            f"{r['tp']:>3} {r['pp']:>3} {r['dp']:>4} {r['zero']:>4} {'on' if r['activation_checkpointing'] else 'off':>4}"
            f" {r['micro_tokens']:>6} {r['micro_batches']:>3} {r['memory_gib']:>7.2f} {r['step_ms']:>9.1f}"
            f" {r['device_ms']:>8.1f} {r['tokens_per_s']:>10,}  {' '.join(r['overrides'])}{mark}"
        )
    b, best = result["budget"], result["fastest"]
    if best["device_ms"] < 0.7 * best["compute_ms"]:
        print(
            f"host-bound: a GPU of the fastest layout is busy {best['device_ms']:.1f} of its {best['compute_ms']:.1f} ms of"
            " compute, waiting on its host the rest; more GPUs split the step's tokens, not its operators"
            " (raise train.tokens_per_step, or lower --host-us where the host is known to be faster)"
        )
    print(f"{b['tokens']:,} tokens at the fastest: {b['hours_at_fastest']:.1f} h; train with: {result['command']}")
