"""``megaformer plan``'s predictions against real runs on this CPU over gloo, layout by layout.

    python benchmarks/plan_check.py [--json]

For each layout (tiny, and transformer_base's width and depth with a 1,000-piece vocabulary and
fp32: tp 1/2, pp 1/2, dp 2 with ZeRO 0/1/2, worlds of 2 ranks on 2 cores) it runs the layout's
real step in local processes (megaformer/plan/measure.py) and predicts it from the traced pieces
(megaformer/plan/trace.py, rank.py, deepspeed.py) on tensors without data in a fake world:

* ``memory_error``: predicted / measured - 1 of rank 0's peak of live tensor storage bytes over a
  steady step (the worst rank's error is ``memory_error_worst``);
* ``collectives_equal``: every collective of rank 0's step (operator, group, count, bytes) as run;
* ``step_error`` (dp=2 layouts): predicted / measured - 1 of rank 0's quickest step. Predicted: the lean
  engine's step recorded and priced with this CPU's constants at one thread (megaformer/sim/calibrate.py:
  each kernel made again and timed, matmuls with the cache emptied where the weights exceed it, the first
  touch of new memory), DeepSpeed's difference from it at dp=2 (megaformer/sim/deepspeed.py: its narrow
  step as rank 0 of a fake world of two), and the step's DP collectives at this host's gloo times for each
  operator and size, measured first (``gloo_s``); ``predicted_parts_ms`` gives the three.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from megaformer.config import load_config  # noqa: E402
from megaformer.plan.measure import link_worker, measure  # noqa: E402
from megaformer.plan.price import pieces  # noqa: E402
from megaformer.plan.rank import predict_rank  # noqa: E402
from megaformer.plan.trace import trace_layers  # noqa: E402
from megaformer.sim.deepspeed import fake_world  # noqa: E402
from megaformer.sim.roofline import GPUS  # noqa: E402
from megaformer.sim.step import MicroShape  # noqa: E402

TINY = str(ROOT / "configs" / "tiny.yaml")
BASE = str(ROOT / "configs" / "transformer_base.yaml")
BASE_ON_CPU = ["train.precision=fp32", "data.vocab_size=1000", "train.zero_stage=0"]
LAYOUTS = [  # (name, config, overrides, micro-batch shape)
    ("tiny dp2 zero0", TINY, ["parallel.dp=2", "train.zero_stage=0"], MicroShape(8, 16, 16)),
    ("tiny dp2 zero1", TINY, ["parallel.dp=2", "train.zero_stage=1"], MicroShape(8, 16, 16)),
    ("tiny dp2 zero2", TINY, ["parallel.dp=2", "train.zero_stage=2"], MicroShape(8, 16, 16)),
    ("tiny tp2", TINY, ["parallel.tp=2", "train.zero_stage=0"], MicroShape(8, 16, 16)),
    ("tiny pp2", TINY, ["parallel.pp=2", "train.zero_stage=0"], MicroShape(8, 16, 16)),
    ("base dp2 zero0", BASE, [*BASE_ON_CPU, "parallel.dp=2"], MicroShape(4, 16, 16)),
    ("base dp2 zero1", BASE, [*BASE_ON_CPU, "parallel.dp=2", "train.zero_stage=1"], MicroShape(4, 16, 16)),
    ("base dp2 zero2", BASE, [*BASE_ON_CPU, "parallel.dp=2", "train.zero_stage=2"], MicroShape(4, 16, 16)),
    ("base tp2", BASE, [*BASE_ON_CPU, "parallel.tp=2"], MicroShape(4, 16, 16)),
    ("base pp2", BASE, [*BASE_ON_CPU, "parallel.pp=2"], MicroShape(4, 16, 16)),
]
MICRO_BATCHES, WORLD = 2, 2


def predicted(config: str, sets: list[str], shape: MicroShape) -> list[dict]:
    cfg = load_config(config, [*sets, "parallel.backend=gloo", "parallel.device=cpu"])
    with fake_world(WORLD):
        traces = trace_layers(cfg, WORLD, cfg.parallel.tp, cfg.model.activation_checkpointing, shape, "cpu")
    parts = pieces(traces, GPUS["h100"])  # memory and collectives only: the device does not matter
    return [predict_rank(cfg, parts, shape, MICRO_BATCHES, s) for s in range(cfg.parallel.pp)]


def predicted_step(config: str, sets: list[str], shape: MicroShape, link: dict, collectives: dict) -> dict:
    """Rank 0's step on this CPU at one thread: the lean step priced, DeepSpeed's difference at the layout's dp
    (megaformer/sim/deepspeed.py), the DP collectives at this host's gloo times. Seconds, by part."""
    import dataclasses

    from megaformer.info import model_info
    from megaformer.sim.calibrate import cpu_device
    from megaformer.sim.deepspeed import deepspeed_extra, with_deepspeed
    from megaformer.sim.roofline import timeline
    from megaformer.sim.step import record_step

    cfg = load_config(config, [*sets, "parallel.backend=gloo", "parallel.device=cpu"])
    one = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=1, tp=1, pp=1))
    parameters = model_info(one)["parameters"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # each of the two ranks has one core
    try:
        ops = record_step(one, [shape] * MICRO_BATCHES, "cpu")
        device = cpu_device(one, MICRO_BATCHES, ops, weight_bytes=4 * parameters)
        os.environ.setdefault("LOCAL_RANK", "0")
        extra = deepspeed_extra(cfg, MICRO_BATCHES, parameters, dp=WORLD)
        lean = timeline(ops, device).seconds
        engine = timeline(with_deepspeed(ops, extra), device).seconds
    finally:
        torch.set_num_threads(threads)
    comm = sum(
        c["count"]
        * gloo_seconds(link[key.split()[0] if key.split()[0] in link else "all_reduce"], c["bytes"] / c["count"])
        for key, c in collectives.items()
        if key.endswith((" dp", " world"))
    )
    return {"lean": lean, "deepspeed": engine - lean, "collectives": comm, "step": engine + comm}


def gloo_seconds(link: dict, nbytes: float) -> float:
    """A collective of ``nbytes`` on this host's gloo (``link``: its times by size): interpolated between the measured sizes (linear in bytes),
    scaled by bytes beyond the largest."""
    sizes = sorted(int(s) for s in link)
    above = next((s for s in sizes if s >= nbytes), None)
    if above is None:
        return link[str(sizes[-1])] * nbytes / sizes[-1]
    below = max((s for s in sizes if s <= nbytes), default=above)
    if below == above:
        return link[str(above)]
    share = (nbytes - below) / (above - below)
    return link[str(below)] + share * (link[str(above)] - link[str(below)])


def run(steps: int, only: str) -> dict:
    from launcher.local import spawn

    out = Path(tempfile.mkdtemp(prefix="plan-check-"))
    spawn(link_worker, WORLD, [4, 1 << 10, 1 << 16, 1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28], str(out))
    link = json.loads((out / "link.json").read_text())
    rows = []
    for name, config, sets, shape in LAYOUTS:
        if only and only not in name:
            continue
        ranks = measure(config, sets, WORLD, [shape] * MICRO_BATCHES, steps, out / name.replace(" ", "-"))
        pp = 2 if "parallel.pp=2" in sets else 1
        guess = predicted(config, sets, shape)
        row = {"layout": name, "sets": sets, "micro_batches": f"{MICRO_BATCHES} x {shape.sentences} x {shape.tgt_len}"}
        errors = []
        for r in ranks:
            stage = r["rank"] // (WORLD // pp) if pp > 1 else 0
            errors.append(guess[stage]["peak"] / r["memory"]["peak"] - 1)
        row["memory_error"] = round(errors[0], 4)
        row["memory_error_worst"] = round(max(errors, key=abs), 4)
        row["collectives_equal"] = guess[0]["collectives"] == ranks[0]["collectives"]
        if not row["collectives_equal"]:
            row["collectives"] = {"predicted": guess[0]["collectives"], "measured": ranks[0]["collectives"]}
        row["measured_step_ms"] = round(ranks[0]["step_s"] * 1e3, 2)
        if "parallel.dp=2" in sets:
            parts = predicted_step(config, sets, shape, link, ranks[0]["collectives"])
            row["predicted_step_ms"] = round(parts["step"] * 1e3, 2)
            row["predicted_parts_ms"] = {k: round(v * 1e3, 2) for k, v in parts.items() if k != "step"}
            row["step_error"] = round(parts["step"] / ranks[0]["step_s"] - 1, 4)
        rows.append(row)
    return {"layouts": rows, "gloo_s": link}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--steps", type=int, default=15, help="timed steps per layout (the quickest counts)")
    p.add_argument("--only", default="", help="layouts whose name holds this text")
    args = p.parse_args(argv)
    result = run(args.steps, args.only)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for r in result["layouts"]:
            print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
