"""Pipeline parallelism: step time at pp=2 against pp=1, the measured bubble against (p-1)/(m+p-1), in one run.

    python benchmarks/pipeline.py [--steps N] [--warmup N] [--micro-batches 4 8] [--gpu | --cpu] [--json]

For each micro-batch count ``m`` (``train.tokens_per_step = m x data.max_tokens``), the
real ``megaformer train`` runs the same model on the same synthetic data twice: at
pp=1 (one process) and at pp=2 (two processes, one stage each). From each run's
``metrics.jsonl`` (``train.log_interval=1``) it reads

- the step time: the median of the per-step ``train_seconds`` differences, after
  ``--warmup`` steps; the ratio pp=2 / pp=1 is printed;
- the bubble: stage 0's ``pipeline_wait`` (its share of the step spent waiting for its
  neighbour: the 1F1B bubble plus the transfers), mean over the steps after warm-up,
  against the formula ``(p - 1) / (m + p - 1)`` for equal stages;
- the losses: the largest relative difference between the two runs' logged losses
  (a pipelined run is the same run: same data, same dropout masks, same steps).

CPU (default without CUDA): configs/tiny.yaml widened so that compute dominates (d_model
128, d_ff 512, 4 + 4 layers), fp32, gloo. The two stages share this machine's cores
(the pp=1 run gets all of them in one process), so the ratio measures the pipeline's
overhead, not a speed-up. ``--gpu`` (the default with CUDA): configs/transformer_big.yaml
at tp=1, bf16, ZeRO-1; with two or more GPUs nccl, one GPU per stage; with one GPU both
stages share it through gloo (``parallel.device=cuda``), which the output says.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megaformer.cli import Parser  # noqa: E402
from megaformer.cli_args import nonneg_int, positive_int  # noqa: E402
from megaformer.parallel.stages import bubble_fraction  # noqa: E402

CPU_MODEL = ["model.d_model=128", "model.d_ff=512", "model.encoder_layers=4", "model.decoder_layers=4"]
COMMON = ["train.log_interval=1", "train.eval_interval=0", "train.save_interval=0", "train.save_minutes=0"]


def _setup(gpu: bool) -> tuple[str, list[str], str]:
    """(config, overrides, a sentence on where the stages run) for this machine."""
    if not gpu:
        return (
            "configs/tiny.yaml",
            CPU_MODEL + ["parallel.device=cpu"],
            "CPU, gloo: both stages share this machine's cores",
        )
    import torch

    sets = ["parallel.tp=1", "train.precision=bf16", "train.zero_stage=1", "parallel.device=cuda"]
    if torch.cuda.device_count() >= 2:
        return "configs/transformer_big.yaml", sets + ["parallel.backend=nccl"], "CUDA, nccl: one GPU per stage"
    sets.append("parallel.backend=gloo")
    return "configs/transformer_big.yaml", sets, "one GPU, gloo: both stages share it (no speed-up to expect)"


def _train(config: str, sets: list[str], pp: int, run_dir: Path, log: Path) -> list[dict]:
    """One ``megaformer train`` run; its ``train`` records."""
    cmd = [sys.executable, "-m", "megaformer.cli", "train", "--config", config, "--run-dir", str(run_dir)]
    cmd += ["--resume", "none", "--nproc", str(pp)]
    for s in [*sets, f"parallel.pp={pp}"]:
        cmd += ["--set", s]
    with open(log, "w") as out:
        code = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"pipeline: pp={pp} train exited {code}, see {log}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "train"]


def _summary(records: list[dict], warmup: int) -> dict:
    """Median step time and mean ``pipeline_wait`` over the steps after ``warmup``."""
    ends = [r["train_seconds"] for r in records]
    steps = [b - a for a, b in zip([0.0, *ends], ends)][warmup:]
    waits = [r["pipeline_wait"] for r in records[warmup:] if "pipeline_wait" in r]
    return {
        "step_s": statistics.median(steps),
        "pipeline_wait": statistics.fmean(waits) if waits else None,
        "losses": [r["loss"] for r in records],
    }


def measure(args: argparse.Namespace, gpu: bool, work: Path) -> dict:
    """Both runs for each micro-batch count; the ratios and the bubble against the formula."""
    config, sets, where = _setup(gpu)
    data = work / "data"
    if not (data / "manifest.json").exists():
        cmd = [sys.executable, "-m", "megaformer.cli", "prepare", "--synthetic", "2000", "--out", str(data), "--quiet"]
        subprocess.run(cmd, cwd=ROOT, check=True)
    max_tokens = 1024 if not gpu else 4096
    rows = []
    for m in args.micro_batches:
        run = [*sets, *COMMON, f"data.path={data}", f"data.max_tokens={max_tokens}"]
        run += [f"train.tokens_per_step={m * max_tokens}", f"train.max_steps={args.steps}"]
        got = {pp: _summary(_train(config, run, pp, work / f"m{m}-pp{pp}", work / f"m{m}-pp{pp}.log"), args.warmup)
               for pp in (1, 2)}  # fmt: skip
        one, two = got[1]["losses"], got[2]["losses"]
        rel = [abs(a - b) / abs(a) for a, b in zip(one, two) if a is not None and b is not None]
        rows.append({
            "micro_batches": m,
            "step_s_pp1": got[1]["step_s"],
            "step_s_pp2": got[2]["step_s"],
            "ratio": got[2]["step_s"] / got[1]["step_s"],
            "bubble_measured": got[2]["pipeline_wait"],
            "bubble_formula": bubble_fraction(2, m),
            "loss_max_rel_diff": max(rel) if rel and len(one) == len(two) else None,
            "steps": len(one),
        })  # fmt: skip
    return {"config": config, "settings": sets, "where": where, "warmup": args.warmup, "rows": rows}


def main() -> int:
    p = Parser(prog="pipeline", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=positive_int, default=14, help="optimizer steps per run")
    p.add_argument("--warmup", type=nonneg_int, default=3, help="first steps left out of the times and the bubble")
    p.add_argument("--micro-batches", type=positive_int, nargs="+", default=[4, 8], metavar="M")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--gpu", action="store_true", help="transformer_big on CUDA (default when CUDA is available)")
    where.add_argument("--cpu", action="store_true", help="the widened tiny model on the CPU")
    p.add_argument("--keep", type=Path, help="keep the runs (and the synthetic data) in this folder")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} leaves nothing after --warmup {args.warmup}")
    gpu = args.gpu
    if not args.gpu and not args.cpu:
        import torch

        gpu = torch.cuda.is_available()
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        result = measure(args, gpu, args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="megaformer-pipeline-") as tmp:
            result = measure(args, gpu, Path(tmp))
    if args.json:
        print(json.dumps(result))
        return 0
    _print(result)
    return 0


def _print(result: dict) -> None:
    print(f"{result['config']} {' '.join(result['settings'])}; {result['where']}")
    print(f"steps after {result['warmup']} warm-up steps; bubble = stage 0's pipeline_wait (bubble + transfers)")
    print(
        f"{'m':>3} {'pp=1 ms':>9} {'pp=2 ms':>9} {'pp2/pp1':>8} {'bubble':>8} {'(p-1)/(m+p-1)':>14} {'loss diff':>10}"
    )
    for r in result["rows"]:
        bubble = "n/a" if r["bubble_measured"] is None else f"{r['bubble_measured']:.1%}"
        diff = "n/a" if r["loss_max_rel_diff"] is None else f"{r['loss_max_rel_diff']:.1e}"
        print(
            f"{r['micro_batches']:>3} {1e3 * r['step_s_pp1']:9.1f} {1e3 * r['step_s_pp2']:9.1f} {r['ratio']:8.2f} "
            f"{bubble:>8} {r['bubble_formula']:14.1%} {diff:>10}"
        )
    if "share" in result["where"]:
        print("the two stages share the same cores: pp2/pp1 is the pipeline's overhead, not a speed-up")
    print("loss diff: the largest relative difference of the logged losses, pp=2 against pp=1, over every step")


if __name__ == "__main__":
    sys.exit(main())
