"""The GPU training step of a config, predicted without a GPU from the real code's operators.

    python benchmarks/gpu_sim.py --config configs/transformer_big.yaml --gpu h200 [--set k=v] [--len 27]
        [--feed-data DIR] [--json]
    python benchmarks/gpu_sim.py --validate [--json]

The first form runs one steady training step of the config as ``megaformer train`` runs it on one
GPU (tp=1, one replica: the lean optimizer, the fused dropout and loss kernels) on the meta device,
records every aten operator (megaformer/sim/ops.py) and prices it on the GPU's roofline with this
CPU's measured host time per operator (megaformer/sim/roofline.py, calibrate.py), after the data
feed's host time (the Trainer's feed run alone on this CPU, megaformer/sim/feed.py). Micro-batches:
sentences of ``--len`` tokens a side (27: WMT'14 en-de's mean in pieces, eos included), as many as
``data.max_tokens`` holds, as many as the step plan gives. It prints the predicted step, target
tokens/s, MFU (6 x parameters x target tokens / (step x dense bf16 peak)), kernels, GB moved, host
reads per step and the operators that take the most device time.

``--validate`` checks the model where it can be measured, in one run on this CPU: the same recorder
and pricing with this CPU's constants (its matmul peak, its bandwidth, its host time per operator,
measured first) predict ``Trainer.step`` of tiny and of transformer_base's shape (fewer tokens a
step, fp32), measured on the same micro-batches right before; the error of each is predicted /
measured - 1, of the quickest step of each (a core shared with another process stalls a step's
threads: the quickest is the machine's own figure). It also predicts the one H200 measurement.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from megaformer import cli  # noqa: E402
from megaformer.cli_args import existing_dir, int_range, positive_int  # noqa: E402
from megaformer.config import Config, load_config  # noqa: E402
from megaformer.cpuinfo import cpu_flags as host_flags  # noqa: E402
from megaformer.errors import MegaformerError  # noqa: E402
from megaformer.info import model_info  # noqa: E402
from megaformer.parallel import fused  # noqa: E402
from megaformer.sim.calibrate import cpu_device, host_seconds_per_op  # noqa: E402
from megaformer.sim.deepspeed import deepspeed_extra, with_deepspeed  # noqa: E402
from megaformer.sim.feed import FeedCost, feed_cost, feed_op  # noqa: E402
from megaformer.sim.roofline import GPUS, StepCost, timeline  # noqa: E402
from megaformer.sim.step import MicroShape, record_step, step_shape  # noqa: E402

# transformer_base's shape on a CPU: its width and depth, steps a 2-core CPU trains in ~1 s
BASE_ON_CPU = ("train.precision=fp32", "train.tokens_per_step=1024", "data.max_tokens=512", "data.vocab_size=1000")


def summary(cfg: Config, shapes: list[MicroShape], cost: StepCost, peak: float, host_op_s: float, top: int) -> dict:
    tokens = sum(m.target_tokens for m in shapes)
    params = model_info(cfg)["parameters"]
    rows = sorted(cost.by_op.items(), key=lambda kv: -kv[1]["seconds"])[:top]
    return {
        "predicted_mfu": round(6 * params * tokens / cost.seconds / peak, 4),
        "target_tokens_per_s": round(tokens / cost.seconds),
        "step_ms": round(cost.seconds * 1e3, 2),
        "device_ms": round(cost.device_seconds * 1e3, 2),
        "host_ms": round(cost.host_seconds * 1e3, 2),
        "kernels_per_step": cost.kernels,
        "gb_per_step": round(cost.bytes / 1e9, 2),
        "tflop_per_step": round(cost.flops / 1e12, 3),
        "host_reads_per_step": cost.host_reads,
        "ops_per_step": cost.ops,
        "host_us_per_op": round(host_op_s * 1e6, 2),
        "target_tokens_per_step": tokens,
        "micro_batches": [[m.sentences, m.src_len, m.tgt_len] for m in shapes],
        "parameters": params,
        "top_ops": [
            {"op": name, "ms": round(r["seconds"] * 1e3, 3), "calls": r["count"], "gb": round(r["bytes"] / 1e9, 3)}
            for name, r in rows
        ],
    }


def predict_gpu(
    cfg: Config, gpu: str, length: int, feed: FeedCost, engine: str = "lean", unfused: bool = False, top: int = 12
) -> dict:
    """The step of ``cfg`` on ``gpu``: the lean engine's, or DeepSpeed's (modelled); ``unfused``: the dropout and
    loss in their many-kernel eager forms (the step before their one-kernel operators); ``feed``: the data
    feed's cost on this CPU, scaled to the step's target tokens."""
    shapes = step_shape(cfg, length)
    host_op_s = host_seconds_per_op(cfg, len(shapes))
    device = GPUS[gpu].with_host(host_op_s)
    feed_s = feed.seconds_for(sum(m.target_tokens for m in shapes))
    with fused.unfused() if unfused else contextlib.nullcontext():
        ops = [feed_op(feed_s), *record_step(cfg, shapes, "meta")]
    modelled = ["SDPA as CUDA's fused kernel (its meta form)", "the data feed: run alone on this CPU, no pinning"]
    if engine == "deepspeed":
        for name, value in (("MASTER_ADDR", "127.0.0.1"), ("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(name, value)  # DeepSpeed's engine, in a world of this one process
        ops = with_deepspeed(ops, deepspeed_extra(cfg, len(shapes), model_info(cfg)["parameters"]))
        modelled.append("DeepSpeed's optimizer: its operators beyond the lean engine's, run at the narrowest width")
    cost = timeline(ops, device)
    head = {"gpu": device.name, "engine": engine, "fused": not unfused, "modelled": modelled}
    head["feed_ms"] = round(feed_s * 1e3, 2)
    return head | summary(cfg, shapes, cost, device.peak_low, host_op_s, top)


# The one GPU measurement (docs/results.md, 2026-11-30, tree ba234f9): transformer_big at tp=1, bf16 DeepSpeed
# ZeRO-1, eager, on the built-in corpus (~12 pieces a sentence and side, a 1,000-piece vocabulary), micro-batches
# of 4,096 tokens: 49,061 target tokens/s on an H200. That tree's dropout and loss are the unfused forms.
H200_2026_11_30 = (("data.vocab_size=1000", "data.max_tokens=4096", "train.precision=bf16", "train.zero_stage=1"), 13)
H200_2026_11_30_MEASURED = 49061


def _trainer(cfg_path: Path, data: Path, run_dir: Path, sets: tuple[str, ...]):
    from megaformer.parallel import ParallelContext
    from megaformer.train.trainer import Trainer

    common = (
        f"data.path={data}", "data.num_workers=0", "train.eval_interval=0", "train.save_interval=0",
        "train.log_interval=1000000", "train.max_steps=100000", "parallel.backend=gloo", "train.optimizer=lean",
    )  # fmt: skip
    cfg = load_config(cfg_path, [*common, *sets])
    ctx = ParallelContext.initialize(cfg.parallel, 0, 1, single_process_group=True)
    trainer = Trainer(cfg, ctx, run_dir, resume="none")
    trainer.engine.train()
    return cfg, ctx, trainer


def measure_and_predict(name: str, cfg_path: Path, sets: tuple[str, ...], data: Path, tmp: Path, steps: int) -> dict:
    """``Trainer.step`` of a config on this CPU, measured, and its prediction on the same micro-batches."""
    from megaformer.train.trainer import StepFlags

    cfg, ctx, trainer = _trainer(cfg_path, data, tmp / f"run-{name}", sets)
    try:
        taken: list = []
        next_step = trainer.feed.next_step
        trainer.feed.next_step = lambda: taken.append(next_step()) or taken[-1]
        flags, times = StepFlags(), []
        for i in range(3 + steps):
            began = time.perf_counter()
            trainer.step(flags)
            if i >= 3:
                times.append(time.perf_counter() - began)
        times.sort()
        shapes_of = [[MicroShape(*m.batch.src.shape[:1], m.batch.src.shape[1], m.batch.tgt_out.shape[1]) for m in s]
                     for s in taken[3:]]  # fmt: skip
    finally:
        ctx.destroy()
    records = [record_step(cfg, shapes, "cpu") for shapes in shapes_of]
    weights = 4 * model_info(cfg)["parameters"]  # fp32
    device = cpu_device(cfg, len(shapes_of[0]), [op for ops in records for op in ops], weight_bytes=weights)
    feed = feed_cost(cfg, data)  # the Trainer's feed alone; a step within an epoch, as the quickest step is
    feed_s = [feed.seconds_for(sum(m.target_tokens for m in shapes), steady=True) for shapes in shapes_of]
    predicted = [timeline([feed_op(f), *ops], device).seconds for f, ops in zip(feed_s, records)]
    # each step's own prediction against its measurement, the quickest of them (a busy core stalls a step's threads)
    measured_s = min(times)
    predicted_s = min(predicted)
    return {
        "predicted_ms": round(predicted_s * 1e3, 2),
        "measured_ms": round(measured_s * 1e3, 2),
        "error": round(predicted_s / measured_s - 1, 3),
        "steps": steps,
        "feed_ms": round(min(feed_s) * 1e3, 2),
        "host_us_per_op": round(device.host_op_s * 1e6, 2),
        "fp32_gflops": round(device.peak_fp32 / 1e9, 1),
        "bandwidth_gbs": {f"{size >> 10} KiB": round(rate / 1e9, 1) for size, rate in device.bandwidth_by_size},
        "kernels_timed": len(device.measured_seconds),
    }


def corpus_feed(cfg: Config, data: Path | None) -> FeedCost:
    """The Trainer's feed of ``cfg`` timed on ``data``, or on a corpus of WMT'14 en-de's lengths made for it."""
    if data is not None:
        return feed_cost(cfg, Path(data))
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):
        made = Path(tmp) / "data"
        argv = ["prepare", "--synthetic", "20000", "--synthetic-shape", "wmt14", "--vocab-size", "1000"]
        if cli.main([*argv, "--out", str(made), "--quiet"]) != 0:
            raise SystemExit("gpu_sim: prepare failed")
        return feed_cost(cfg, made)


def validate(steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp_name, contextlib.redirect_stdout(sys.stderr):  # the trainer's log
        tmp = Path(tmp_name)
        data = tmp / "data"
        if cli.main(["prepare", "--synthetic", "4000", "--out", str(data), "--quiet"]) != 0:
            raise SystemExit("gpu_sim: prepare failed")
        cpu = {  # tiny's steps take ~40 ms: four times as many, for a quickest step as steady as base's
            "tiny": measure_and_predict("tiny", ROOT / "configs/tiny.yaml", (), data, tmp, 4 * steps),
            "base": measure_and_predict("base", ROOT / "configs/transformer_base.yaml", BASE_ON_CPU, data, tmp, steps),
        }
        sets, length = H200_2026_11_30
        cfg = load_config(ROOT / "configs/transformer_big.yaml", ["parallel.tp=1", *sets])
        # that run's corpus (the built-in one, 4,000 pairs: an epoch every ~2 steps) through that tree's feed
        feed = feed_cost(cfg, data, steps=30, restart_each_epoch=True)
    old = predict_gpu(cfg, "h200", length, feed, engine="deepspeed", unfused=True)
    return {
        "cpu": cpu,
        "h200_2026_11_30_tokens_per_s": old["target_tokens_per_s"],
        "h200_2026_11_30_measured": H200_2026_11_30_MEASURED,
        "h200_2026_11_30_error": round(old["target_tokens_per_s"] / H200_2026_11_30_MEASURED - 1, 3),
        "h200_2026_11_30": old,
        "cpu_flags": cpu_flags(),
        "threads": torch.get_num_threads(),
    }


def cpu_flags() -> list[str]:
    have = host_flags()
    return [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in have]


def main(argv: list[str] | None = None) -> int:
    p = cli.Parser(prog="gpu_sim", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs/transformer_big.yaml"))
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--gpu", choices=sorted(GPUS), default="h200")
    p.add_argument("--len", type=int_range(2, 1024), default=27, help="tokens a sentence, each side, eos included (27)")
    p.add_argument("--top", type=positive_int, default=12)
    p.add_argument(
        "--engine", choices=["lean", "deepspeed"], default="lean", help="the optimizer path (lean: one GPU's)"
    )
    p.add_argument(
        "--unfused", action="store_true", help="the dropout and loss as many eager kernels (the step before)"
    )
    p.add_argument(
        "--feed-data",
        type=existing_dir,
        metavar="DIR",
        help="a prepared corpus to time the data feed on (default: 20,000 pairs of WMT'14's shape, made for the run)",
    )
    p.add_argument("--validate", action="store_true", help="predict this CPU's measured steps (tiny, base)")
    p.add_argument("--steps", type=positive_int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        if args.validate:
            result = validate(args.steps)
        else:
            cfg = load_config(args.config, ["parallel.tp=1", *args.overrides])
            result = predict_gpu(cfg, args.gpu, args.len, corpus_feed(cfg, args.feed_data), args.engine, args.unfused,
                                 args.top)  # fmt: skip
    except MegaformerError as err:  # a config or data the step cannot be built from: one line
        print(f"gpu_sim: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1) if args.json else _text(result))
    return 0


def _text(r: dict) -> str:
    if "cpu" in r:
        lines = [
            f"{name}: predicted {v['predicted_ms']} ms, measured {v['measured_ms']} ms, error {v['error']:+.1%}"
            for name, v in r["cpu"].items()
        ]
        return "\n".join(
            lines + [f"H200 2026-11-30: predicted {r['h200_2026_11_30_tokens_per_s']:,} target tok/s, measured "
                     f"{r['h200_2026_11_30_measured']:,}, error {r['h200_2026_11_30_error']:+.1%}"]
        )  # fmt: skip
    lines = [
        f"{r['gpu']}: step {r['step_ms']} ms (device {r['device_ms']}, host {r['host_ms']}, the feed {r['feed_ms']} of it), "
        f"{r['target_tokens_per_s']:,} target tok/s, MFU {r['predicted_mfu']:.1%}",
        f"{r['kernels_per_step']} kernels, {r['gb_per_step']} GB, {r['tflop_per_step']} TFLOP, "
        f"{r['host_reads_per_step']} host reads a step; host {r['host_us_per_op']} us an operator (this CPU)",
    ]
    lines += [f"  {o['op']:<48} {o['ms']:8.3f} ms {o['calls']:5d} calls {o['gb']:7.2f} GB" for o in r["top_ops"]]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
