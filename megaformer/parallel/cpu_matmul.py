"""fp32 linear layers on a CPU through oneDNN where torch's default BLAS would run them at half speed.

torch multiplies fp32 matrices on a CPU with MKL's ``sgemm``, which picks its code by the CPU's
vendor: on AMD EPYCs with AVX-512 it runs its AVX2 kernels. oneDNN (torch's ``mkldnn``, which
torch already uses for bf16) picks its kernels by the instruction set. On the 2-core AVX-512
EPYC a linear layer's three products (forward, input and weight gradients) took half the time
through oneDNN (1,000 x 256 -> 1,024: 7.7 against 4.2 ms; decoding's 720 x 256 x 8,064: 178
against 439 GFLOP/s); capped at AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``) the two libraries were within
10 % of each other. CTranslate2 leaves MKL out on CPUs not made by Intel for the same reason.

:func:`linear` is ``F.linear`` with that choice, forward and backward (:class:`_OneDnnLinear`:
oneDNN's linear kernel has no backward in torch; the gradients are two more oneDNN products and a
sum, as ``F.linear``'s). Compiled code keeps ``F.linear`` (Inductor picks its own kernels), and so
does a layer with fewer than ``MIN_FEATURES`` inputs or outputs. An fp32 training step of the Multi30k
preset took 0.65x its time (596 -> 388 ms, median), transformer_base's shape 0.55x.

``MEGAFORMER_CPU_MATMUL`` chooses for a process: ``onednn``, ``blas`` (torch's default), or
``auto`` (the default: oneDNN on a CPU not made by Intel that has AVX-512, unless oneDNN is
capped below it by ``ONEDNN_MAX_CPU_ISA``).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from megaformer import cpuinfo

# A layer narrower than this keeps MKL: tiny's (64 wide) trained 1.3x slower through oneDNN, its weight
# gradients' transposed operands costing more than its products gained; 256 wide: 1.5x faster.
MIN_FEATURES = 128


@functools.cache
def onednn_for_fp32() -> bool:
    """Whether fp32 linear layers run through oneDNN in this process (see the module docstring)."""
    choice = cpuinfo.matmul_setting()
    available = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    if choice != "auto" or not available:
        return available and choice == "onednn"
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    capped = isa not in ("ALL", "DEFAULT") and not isa.startswith(("AVX512", "AVX10", "AMX"))  # below AVX-512
    vendor = cpuinfo.cpu_field("vendor_id")
    return vendor not in ("GenuineIntel", "") and "avx512f" in cpuinfo.cpu_flags() and not capped


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through oneDNN for fp32 on a CPU where :func:`onednn_for_fp32`."""
    if (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.dtype == torch.float32
        and min(weight.shape) >= MIN_FEATURES
        and not torch.compiler.is_compiling()
        and onednn_for_fp32()
    ):
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return _OneDnnLinear.apply(x, weight, bias)
        return _onednn(x, weight, bias)
    return F.linear(x, weight, bias)


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b through oneDNN (any strides; ``weight`` is (out, in))."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _OneDnnLinear(torch.autograd.Function):
    """``F.linear`` whose three products run through oneDNN."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])  # (tokens, out)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn(grad, weight.t(), None)  # (..., in) = grad W
        if ctx.needs_input_grad[1]:
            grad_weight = _onednn(rows.t(), x.reshape(-1, x.shape[-1]).t(), None)  # (out, in) = grad^T x
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = rows.sum(0)
        return grad_x, grad_weight, grad_bias
