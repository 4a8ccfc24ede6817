"""Training metrics: ``metrics.jsonl``, tensorboard and a concise console line (rank 0 only).

MFU = achieved training FLOP/s (6 x parameters x target tokens per second) divided by
the peak of all devices together: ``train.peak_tflops`` per device when set, otherwise a
table of known GPUs (dense bf16/fp16 tensor-core peak) or, on a CPU, a matmul of the
training precision measured once at start-up by every rank at the same time (summed).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

# Dense tensor-core peak in TFLOP/s (bf16/fp16) of GPUs by name.
GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "V100": 125.0}


def measured_matmul_peak(dtype: torch.dtype, n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of an n x n matmul on this CPU (median of ``repeats``)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * n**3 / sorted(times)[len(times) // 2]


def device_peak_flops(device: torch.device, precision: str, override_tflops: float = 0.0) -> float:
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in GPU_PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12 / (1 if precision != "fp32" else 2)
        return float("nan")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return measured_matmul_peak(dtype)


class MetricsLogger:
    """Appends one JSON object per logged step to ``metrics.jsonl`` and mirrors it to tensorboard."""

    def __init__(self, run_dir: Path, enabled: bool, max_steps: int) -> None:
        self.enabled = enabled
        self.max_steps = max_steps
        self.start = time.monotonic()
        self.writer = None
        self.file = None
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.file = open(run_dir / "metrics.jsonl", "a", buffering=1)
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(run_dir / "tensorboard"))
            except Exception as err:  # tensorboard missing or broken: keep the JSON log
                print(f"train: tensorboard disabled ({err})", file=sys.stderr)

    def log(self, record: dict, prefix: str = "train") -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps({"kind": prefix, **record}) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(f"{prefix}/{key}", value, record["step"])

    def console(self, r: dict) -> None:
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.start
        line = (
            f"step {r['step']:>6d}/{self.max_steps} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | "
            f"gnorm {r['grad_norm']:.3f} | {r['tokens_per_s']:,.0f} tok/s | mfu {100 * r['mfu']:.1f}% | "
            f"epoch {r['epoch']} | {_hms(elapsed)}"
        )
        if r["loss_scale"] != 1.0:
            line += f" | scale {r['loss_scale']:g}"
        print(line, flush=True)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.writer is not None:
            self.writer.close()


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
