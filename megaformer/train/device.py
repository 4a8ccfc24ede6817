"""Process-wide numerics of a training run on its device, set once at start-up.

fp32 training on a GPU runs its matmuls in TF32 (10-bit mantissa inputs, fp32
accumulation): Ampere and later GPUs reach 8x (A100) to 7x (H100) their CUDA-core fp32
rate that way, and DeepSpeed, Megatron and fairseq train fp32 models so. Without it an
fp32 run on an H200 computes at 67 TFLOP/s instead of 494. The loss of mantissa bits in
the inputs is the price; ``--set train.precision=...`` does not change it, bf16/fp16 runs
are unaffected (their matmuls are already in 16 bits). On a CPU nothing is changed.

On a CPU the large tensors go into transparent huge pages when the process started with
``THP_MEM_ALLOC_ENABLE=1`` (the CLI's default, :func:`megaformer.cli.host_memory_defaults`);
:func:`host_memory` says which pages a CPU run's tensors get, for the log.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from megaformer.cpuinfo import CPUINFO, cpu_flags
from megaformer.errors import ConfigError

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # the CPU instructions oneDNN runs bf16 matmuls with
# ONEDNN_MAX_CPU_ISA values that keep oneDNN below its bf16 instructions (it emulates bf16 then).
ISA_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")


def cpu_bf16_missing(cpuinfo: Path = CPUINFO) -> str | None:
    """None where this CPU computes bf16 matmuls natively; otherwise why not, in words (for a one-line message).

    Without AVX512-BF16 or AMX-BF16, torch emulates bf16 in fp32 and rounds: correct, but
    several times slower than fp32 itself.
    """
    flags = cpu_flags(cpuinfo)
    have = [f for f in BF16_FLAGS if f in flags]
    if not have:
        vector = "avx512f" if "avx512f" in flags else "avx2" if "avx2" in flags else "no AVX2"
        return f"this CPU has no native bf16 ({' or '.join(BF16_FLAGS)} missing; it has {vector})"
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if isa in ISA_WITHOUT_BF16:
        return f"ONEDNN_MAX_CPU_ISA={isa} keeps oneDNN from this CPU's {', '.join(have)}"
    return None


def configure_math(device: torch.device, precision: str) -> str:
    """Allow TF32 matmuls for fp32 training on CUDA; returns what was set, for the log."""
    if device.type != "cuda":
        missing = cpu_bf16_missing() if precision == "bf16" else None
        if missing:
            return f"{precision} matmuls on cpu, emulated: {missing}; train.precision=fp32 trains several times faster here"
        return f"{precision} matmuls on {device.type}"
    if precision == "fp32":
        torch.set_float32_matmul_precision("high")  # TF32 for fp32 matmuls
        return "fp32 training with TF32 matmuls (torch.set_float32_matmul_precision('high'))"
    return f"{precision} matmuls on {torch.cuda.get_device_name(device)}"


def kernel_thp_mode(path: Path = THP_MODE) -> str:
    """The kernel's transparent huge page mode (always, madvise, never), or ``unknown``."""
    try:
        return next(word[1:-1] for word in path.read_text().split() if word.startswith("["))
    except (OSError, StopIteration):
        return "unknown"


def host_memory(device: torch.device, thp_mode: Path = THP_MODE) -> str | None:
    """Which pages a CPU run's tensors of 2 MiB or more get, for the log (None on a GPU)."""
    if device.type != "cpu":
        return None
    mode = kernel_thp_mode(thp_mode)
    if os.environ.get("THP_MEM_ALLOC_ENABLE") != "1":  # torch reads "1" as on, "0" as off, warns on others
        if mode == "always":  # the kernel gives large mappings huge pages unasked
            return "CPU tensors in huge pages where the kernel puts them (kernel: always; THP_MEM_ALLOC_ENABLE not 1)"
        return "CPU tensors in 4 KiB pages (THP_MEM_ALLOC_ENABLE is not 1)"
    if mode == "never":
        return "CPU tensors in 4 KiB pages: THP_MEM_ALLOC_ENABLE=1 but the kernel's transparent huge pages are off"
    return f"CPU tensors of 2 MiB or more in transparent huge pages (THP_MEM_ALLOC_ENABLE=1, kernel: {mode})"


def require_cpp_compiler() -> None:
    """Inductor builds its CPU kernels with a C++ compiler; without one the first step would fail."""
    from torch._inductor import cpp_builder

    try:
        cpp_builder.get_cpp_compiler()
    except Exception as exc:  # Inductor raises its own error type, whose name differs between versions
        raise ConfigError(
            "train.compile: no C++ compiler for Inductor's CPU kernels (g++, or $CXX): "
            "install one or set train.compile=false"
        ) from exc
