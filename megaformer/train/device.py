"""Process-wide numerics of a training run on its device, set once at start-up.

fp32 training on a GPU runs its matmuls in TF32 (10-bit mantissa inputs, fp32
accumulation): Ampere and later GPUs reach 8x (A100) to 7x (H100) their CUDA-core fp32
rate that way, and DeepSpeed, Megatron and fairseq train fp32 models so. Without it an
fp32 run on an H200 computes at 67 TFLOP/s instead of 494. The loss of mantissa bits in
the inputs is the price; ``--set train.precision=...`` does not change it, bf16/fp16 runs
are unaffected (their matmuls are already in 16 bits). On a CPU nothing is changed.
"""

from __future__ import annotations

import torch


def configure_math(device: torch.device, precision: str) -> str:
    """Allow TF32 matmuls for fp32 training on CUDA; returns what was set, for the log."""
    if device.type != "cuda":
        return f"{precision} matmuls on {device.type}"
    if precision == "fp32":
        torch.set_float32_matmul_precision("high")  # TF32 for fp32 matmuls
        return "fp32 training with TF32 matmuls (torch.set_float32_matmul_precision('high'))"
    return f"{precision} matmuls on {torch.cuda.get_device_name(device)}"
