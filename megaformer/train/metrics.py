"""Training metrics: ``metrics.jsonl``, tensorboard and a concise console line (rank 0 only).

MFU = achieved training FLOP/s (6 x parameters x target tokens per second) divided by
the peak of all devices together: ``train.peak_tflops`` per device when set, otherwise a
table of known GPUs (dense tensor-core peak of the precision the matmuls run in: bf16/fp16,
or TF32 for fp32 training, see :func:`megaformer.train.device.configure_math`) or, on a
CPU, a matmul of the training precision measured once at start-up by every rank at the
same time (summed).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from megaformer.errors import ConfigError
from megaformer.parallel.cpu_matmul import linear

LOG = logging.getLogger(__name__)

# Dense (not 2:4 sparse) peak TFLOP/s per GPU from the vendors' data sheets, by a part of the
# name torch reports; the first match wins, so the PCIe/NVL variants come before the SXM part.
# "tf32": fp32 matmuls on tensor cores (fp32 training here); "fp32": without them (CUDA cores).
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0},
    "H200 NVL": {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},  # SXM
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},  # SXM
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6},
    "L40": {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "V100": {"fp16": 125.0, "fp32": 15.7},  # no bf16 or TF32 tensor cores
}


def gpu_peak_tflops(name: str, precision: str, tf32: bool = True) -> float:
    """Dense peak TFLOP/s of the GPU called ``name`` for ``precision``; nan if unknown.

    fp32 training counts the TF32 tensor-core peak when ``tf32`` (matmuls allowed to run in
    TF32, :func:`megaformer.train.device.configure_math`), else the CUDA-core fp32 peak: 67
    TFLOP/s on an H100/H200, not bf16 / 2 = 494, which only TF32 reaches.
    """
    kind = "tf32" if precision == "fp32" and tf32 else precision
    for key, peaks in GPU_PEAK_TFLOPS.items():
        if key in name:
            return peaks.get(kind, peaks.get("fp32", float("nan")) if kind == "tf32" else float("nan"))
    return float("nan")


def measured_matmul_peak(
    dtype: torch.dtype,
    n: int = 1024,
    repeats: int = 5,
    slow: float = 0.02,
    window: float = 0.25,
    settle: float = 0.005,
) -> float:
    """FLOP/s of an n x n matmul on this CPU: the 90th percentile of at least ``repeats``, timed for ``window`` s.

    A peak is what the core reaches, so the measurement looks past the moments it did not
    get: at a training's start the ranks and their helper threads wake for bursts of a few
    milliseconds, and a median of five matmuls of ~2 ms (bf16 on AMX) took one rank's
    burst for the peak in a third of the starts (400-700 GFLOP/s against ~1,200 measured
    in the same second), so the MFU logged by identical runs differed 3x.

    The size doubles from 128 to ``n`` while a warm matmul takes under ``slow`` seconds (the
    quickest of those timed over ``settle`` s, at least two: one that lost the core for a moment
    stopped the doubling at 128, and a peak 1,000x too low hid every MFU of the run), so a
    dtype the CPU only emulates (bf16 or fp16 without AVX512-BF16/AMX: ~0.8 GFLOP/s on AVX2,
    50x below fp32) is measured in a fraction of a second, not in the 16 s that 1024 x 1024
    took there, on every rank of every start. The first call at each size only warms the
    kernel up: timed, its set-up stopped the doubling at a small size, whose lower FLOP/s put
    the MFU of fp32 training above 100 %.
    """

    def took(a: torch.Tensor, b: torch.Tensor) -> float:
        t = time.perf_counter()
        linear(a, b)  # a b^T through the library the model's layers use (parallel/cpu_matmul.py)
        return time.perf_counter() - t

    def quickest(a: torch.Tensor, b: torch.Tensor) -> float:
        start, times = time.perf_counter(), [took(a, b), took(a, b)]
        while time.perf_counter() - start < settle:
            times.append(took(a, b))
        return min(times)

    size = min(128, n)
    while True:
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        a @ b
        if size >= n or quickest(a, b) >= slow:
            break
        size *= 2
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < repeats or time.perf_counter() - start < window:
        times.append(took(a, b))
    return 2 * size**3 / sorted(times)[(len(times) - 1) // 10]  # the 90th percentile of the rates


def device_peak_flops(device: torch.device, precision: str, override_tflops: float = 0.0) -> float:
    """Peak FLOP/s of one device for MFU: the override, the GPU table, or a matmul measured on a CPU."""
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type == "cuda":
        tf32 = torch.get_float32_matmul_precision() != "highest"
        return gpu_peak_tflops(torch.cuda.get_device_name(device), precision, tf32) * 1e12
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return measured_matmul_peak(dtype)


def peak_source(device: torch.device, override_tflops: float = 0.0) -> str:
    """Where :func:`device_peak_flops`' figure comes from, for the log."""
    if override_tflops > 0:
        return "train.peak_tflops"
    return "the GPU's datasheet" if device.type == "cuda" else "a matmul timed at start-up; train.peak_tflops sets it"


@dataclass
class Peak:
    """The peak FLOP/s of all ranks together that MFU is measured against, and where the figure comes from.

    A CPU's peak is timed at start-up, when other work may hold the cores: a run then
    computes more than its "peak" (an MFU of 145 % was logged). Such an MFU is not shown,
    and the log says once why and what to set.
    """

    flops: float
    source: str
    ranks: int
    doubted: bool = False  # the run has computed more than this peak

    def describe(self) -> str:
        n = self.ranks
        if not math.isfinite(self.flops):
            return "MFU not shown: no peak for this device in megaformer's table: set train.peak_tflops"
        return f"MFU against {self.flops / 1e12:.3g} TFLOP/s, the peak of {n} rank{'s' * (n > 1)} ({self.source})"

    def mfu(self, flops_per_s: float, log: Callable[[str], None]) -> float | None:
        """``flops_per_s`` as a share of the peak; None (said once through ``log``) beyond it."""
        share = flops_per_s / self.flops
        if not math.isfinite(share):  # no peak known: said at start-up
            return None
        if share <= 1.0:
            return share
        if not self.doubted:
            self.doubted = True
            why = "" if self.source == "train.peak_tflops" else " (timed while other work held the cores?)"
            log(
                f"train: MFU not shown: the run computes {flops_per_s / 1e12:.3g} TFLOP/s, more than the peak of "
                f"{self.flops / 1e12:.3g} it is measured against{why}: set train.peak_tflops to the device's peak"
            )
        return None


class MetricsLogger:
    """Appends one JSON object per logged step to ``metrics.jsonl`` and mirrors it to tensorboard."""

    def __init__(self, run_dir: Path, enabled: bool, max_steps: int) -> None:
        self.enabled = enabled
        self.max_steps = max_steps
        self.start = time.monotonic()
        self.writer = None
        self.file = None
        self.path = run_dir / "metrics.jsonl"
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            try:
                self.file = open(self.path, "a", buffering=1)
            except OSError as err:
                raise ConfigError(
                    f"{self.path}: cannot be written ({err.strerror}): make it a writable file, or use another --run-dir"
                ) from None
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(run_dir / "tensorboard"))
            except Exception as err:  # tensorboard missing or broken: keep the JSON log
                LOG.warning(f"train: tensorboard disabled ({err})")

    def log(self, record: dict, prefix: str = "train") -> None:
        if not self.enabled:
            return
        # JSON has no NaN or Infinity: a non-finite value (an fp16 overflow's norm) is written as null.
        clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        if self.file is not None:
            try:
                self.file.write(json.dumps({"kind": prefix, **clean}, allow_nan=False) + "\n")
            except OSError as err:  # a full disk or a vanished file: training and its checkpoints go on
                LOG.warning(
                    f"train: {self.path}: cannot be written from step {record.get('step')} on ({err.strerror}); "
                    f"training goes on without it"
                )
                self._close_file()
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(f"{prefix}/{key}", value, record["step"])

    def console(self, r: dict) -> None:
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.start
        loss = "skipped" if r["loss"] is None else f"{r['loss']:.4f}"  # only fp16 overflow steps since the last line
        norm = "-" if r["grad_norm"] is None else f"{r['grad_norm']:.3f}"
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"  # None: beyond the peak measured
        line = (
            f"step {r['step']:>6d}/{self.max_steps} | loss {loss} | lr {r['lr']:.2e} | "
            f"gnorm {norm} | {r['tokens_per_s']:,.0f} tok/s | mfu {mfu} | "
            f"epoch {r['epoch']} | {_hms(elapsed)}"
        )
        if r["loss_scale"] != 1.0:
            line += f" | scale {r['loss_scale']:g}"
        LOG.info(line)

    def console_valid(self, r: dict) -> None:
        """The validation line: loss, NLL, perplexity, and greedy BLEU (cased, lowercased) when computed."""
        if not self.enabled:
            return
        line = f"valid  {r['step']:>6d} | loss {r['loss']:.4f} | nll {r['nll']:.4f} | ppl {r['ppl']:.2f}"
        if "bleu" in r:
            line += f" | bleu {r['bleu']:.2f} | bleu_lc {r['bleu_lc']:.2f}"
        if "bleu_tok" in r:
            line += f" | bleu_tok {r['bleu_tok']:.2f}"
        LOG.info(line)

    def _close_file(self) -> None:
        file, self.file = self.file, None
        try:
            file.close()
        except OSError:
            pass  # the buffered line that could not be written

    def close(self) -> None:
        if self.file is not None:
            self._close_file()
        if self.writer is not None:
            self.writer.close()


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
