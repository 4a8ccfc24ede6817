"""fp32 linear layers on a CPU through oneDNN where torch's default BLAS would run them at half speed.

torch multiplies fp32 matrices on a CPU with MKL's ``sgemm``, which picks its code by the CPU's
vendor: on AMD EPYCs with AVX-512 it runs its AVX2 kernels. oneDNN (torch's ``mkldnn``, which
torch already uses for bf16) picks its kernels by the instruction set. On the 2-core AVX-512
EPYC a decoder's linear layers ran 2.2x as fast through oneDNN (720 x 256 x 1024: 206 against
468 GFLOP/s; the logits' 720 x 256 x 8064: 178 against 439), which is what CTranslate2 does
on such CPUs (it leaves MKL out on every CPU not made by Intel).

:func:`linear` is ``F.linear`` with that choice. It takes oneDNN only where nothing needs a
gradient (decoding, validation): oneDNN's linear kernel has no backward in torch, and training
keeps MKL's arithmetic, which resumed runs and recorded loss curves are bitwise bound to.

``MEGAFORMER_CPU_MATMUL`` chooses for a process: ``onednn``, ``blas`` (torch's default), or
``auto`` (the default: oneDNN on a CPU not made by Intel, where torch has it).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from megaformer.errors import ConfigError

CHOICES = ("auto", "onednn", "blas")


@functools.cache
def onednn_for_fp32() -> bool:
    """Whether fp32 linear layers without gradients run through oneDNN in this process (see the module docstring)."""
    choice = os.environ.get("MEGAFORMER_CPU_MATMUL", "auto")
    if choice not in CHOICES:
        raise ConfigError(f"MEGAFORMER_CPU_MATMUL={choice!r}: expected one of {', '.join(CHOICES)}")
    available = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    if choice != "auto" or not available:
        return available and choice == "onednn"
    return _cpu_vendor() not in ("GenuineIntel", "")


def _cpu_vendor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; through oneDNN for fp32 on a CPU where :func:`onednn_for_fp32` and no gradient."""
    if (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.dtype == torch.float32
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and onednn_for_fp32()
    ):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
