"""Helpers of the end-to-end training tests: the tiny run's settings, starting a training, reading its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAKES = ROOT / "tests" / "fakes"
TINY = ROOT / "configs" / "tiny.yaml"


def common(corpus: Path) -> list[str]:
    # A short warm-up to a high learning rate, so that runs of 30 steps show the loss falling.
    return [
        f"data.path={corpus}",
        "data.max_tokens=512",
        "data.num_workers=0",
        "train.tokens_per_step=1024",
        "train.log_interval=1",
        "train.eval_interval=0",
        "train.save_interval=10",
        "train.keep_last=5",
        "train.lr_scale=2.0",
        "train.warmup_steps=100",
        # MFU's denominator given: each rank would otherwise time a 1024 x 1024 matmul at start-up
        # (~0.2 CPU s, ~7 % of a short 2-rank run); test_device_path tests the measurement.
        "train.peak_tflops=0.1",
    ]


def train(
    run_dir: Path,
    nproc: int,
    sets: list[str],
    fault: str = "",
    extra_env: dict | None = None,
    resume: str = "auto",
    timeout: int = 600,
) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": f"{FAKES}{os.pathsep}{ROOT}",
        "OMP_NUM_THREADS": "1",
        "MEGAFORMER_TEST_FAULT": fault,
        **(extra_env or {}),
    }
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    env = {name: value for name, value in env.items() if value is not None}  # extra_env None: unset
    args = [
        sys.executable,
        "-m",
        "megaformer.cli",
        "train",
        "--config",
        str(TINY),
        "--run-dir",
        str(run_dir),
        "--nproc",
        str(nproc),
        "--resume",
        resume,
        "--set",
        "parallel.backend=gloo",  # CPU tensors through gloo, also where CUDA is visible
    ]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)


def megaformer(*args, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m megaformer.cli ARGS`` from the repository root, its output captured."""
    argv = [sys.executable, "-m", "megaformer.cli", *map(str, args)]
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def records(run_dir: Path, kind: str) -> list[dict]:
    """Every record of ``kind`` (train, valid) in metrics.jsonl, in the order logged."""
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r for r in rows if r["kind"] == kind]


def train_records(run_dir: Path) -> list[dict]:
    """Every training record in metrics.jsonl, in the order logged (a resumed run logs the replayed steps again)."""
    return records(run_dir, "train")


def losses(run_dir: Path) -> dict[int, dict]:
    """The last record logged for each step."""
    return {r["step"]: r for r in train_records(run_dir)}


def ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def falling(curve: dict[int, dict]) -> bool:
    steps = sorted(curve)
    first = sum(curve[s]["loss"] for s in steps[:5]) / 5
    last = sum(curve[s]["loss"] for s in steps[-5:]) / 5
    return last < first - 0.5
