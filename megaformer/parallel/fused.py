"""One-kernel forms, on a GPU, of the step's element-wise work that eager PyTorch runs as many kernels.

Each is a ``torch.library`` custom operator, so that autograd, ``FakeTensorMode``, the meta
device (the step's simulation, :mod:`megaformer.sim`) and a compiled graph see one operator:

* ``megaformer::dropout`` -- ``x * keep(key) * scale`` with the counter-based mask of
  :mod:`megaformer.parallel.rng`. Eagerly on a GPU the mask is ~14 kernels of int64
  arithmetic; here it is one kernel that computes each element's bits, compares and scales.
  Its backward is the same operator on the gradient, with the same key: no mask is kept.
* ``megaformer::ce_sums`` -- per row of the logits (N, V), ``sum exp(max(z - m, floor))`` and
  ``sum z`` in one pass, reading the logits in their own dtype (no fp32 copy of N x V).
* ``megaformer::ce_grad`` -- the loss's gradient written straight into the logits' dtype
  from the logits, m, the per-row scale and shift and the target column: one pass.

On CUDA each runs a ``torch.compile``d function (one Triton kernel each; compiled once with
dynamic sizes, so every length and every key reuses it). Elsewhere, and on CUDA if compiling
fails (the failure is said once), the same function runs eagerly: the values are the same,
the masks bit for bit (integer arithmetic), the sums and gradient to rounding.
The CPU's own forms (cache-sized blocks, the mask kept) stay in ``rng.py`` and ``loss.py``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

from megaformer.errors import MegaformerWarning

_compiled: dict[str, object] = {}
_failed: set[str] = set()
_off: list[bool] = []  # inside :func:`unfused`


def enabled() -> bool:
    """Whether the callers take these operators (not inside :func:`unfused`)."""
    return not _off


@contextlib.contextmanager
def unfused() -> Iterator[None]:
    """Inside the block the dropout and the loss take their many-kernel eager forms (the step as it was
    before these operators: what the simulation compares them with)."""
    _off.append(True)
    try:
        yield
    finally:
        _off.pop()


def _run(name: str, fn, *args):
    """``fn(*args)``, through ``torch.compile`` on CUDA (eagerly if that fails, said once)."""
    if args[0].device.type != "cuda" or name in _failed:
        return fn(*args)
    kernel = _compiled.get(name)
    if kernel is None:
        kernel = _compiled[name] = torch.compile(fn, dynamic=True, fullgraph=True)
    try:
        return kernel(*args)
    except Exception as err:  # noqa: BLE001 - any compiler failure: the eager form computes the same
        _failed.add(name)
        warnings.warn(f"{name}: compiling its GPU kernel failed ({err}); it runs eagerly", MegaformerWarning, 2)
        return fn(*args)


# ---- dropout ---------------------------------------------------------------------------------


def _dropout_math(x: torch.Tensor, key: torch.Tensor, threshold: int, scale: float) -> torch.Tensor:
    from megaformer.parallel.rng import bits_at_positions

    bits = bits_at_positions(x.numel(), key).view(x.shape)
    keep = (bits >= threshold).to(x.dtype)
    return (x * keep) * scale


@torch.library.custom_op("megaformer::dropout", mutates_args=())
def dropout(x: torch.Tensor, key: int, threshold: int, scale: float) -> torch.Tensor:
    """x * keep * scale, element e kept when its 16 random bits of ``key`` reach ``threshold``."""
    key_tensor = torch.full((), key, dtype=torch.int64, device=x.device)
    return _run("megaformer::dropout", _dropout_math, x.contiguous(), key_tensor, threshold, scale)


@dropout.register_fake
def _(x, key, threshold, scale):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _dropout_backward(ctx, grad):
    return dropout(grad, ctx.key, ctx.threshold, ctx.scale), None, None, None


def _dropout_context(ctx, inputs, output):
    _, ctx.key, ctx.threshold, ctx.scale = inputs


dropout.register_autograd(_dropout_backward, setup_context=_dropout_context)


# ---- the loss's passes ----------------------------------------------------------------------


def _sums_math(z: torch.Tensor, m: torch.Tensor, floor: float) -> torch.Tensor:
    shifted = (z.float() - m.unsqueeze(-1)).clamp_min(floor)
    return torch.stack([shifted.exp().sum(-1), z.float().sum(-1)])


@torch.library.custom_op("megaformer::ce_sums", mutates_args=())
def ce_sums(z: torch.Tensor, m: torch.Tensor, floor: float) -> torch.Tensor:
    """(2, N) fp32: per row of ``z`` (N, V), sum of exp(max(z - m, floor)) and sum of z."""
    return _run("megaformer::ce_sums", _sums_math, z, m, floor)


@ce_sums.register_fake
def _(z, m, floor):
    return z.new_empty((2, z.shape[0]), dtype=torch.float32)


def _grad_math(
    z: torch.Tensor,
    m: torch.Tensor,
    floor: float,
    scale: torch.Tensor,
    shift: torch.Tensor,
    column: torch.Tensor,
    at_column: torch.Tensor,
    real_cols: int,
) -> torch.Tensor:
    """exp(max(z - m, floor)) * scale + shift per row, less ``at_column`` at the row's ``column``; 0 from
    column ``real_cols`` on (padded vocabulary rows never get probability)."""
    columns = torch.arange(z.shape[-1], device=z.device)
    target = (columns == column.unsqueeze(-1)).float() * at_column.unsqueeze(-1)
    probs = (z.float() - m.unsqueeze(-1)).clamp_min(floor).exp()
    grad = probs * scale.unsqueeze(-1) + shift.unsqueeze(-1) - target
    return torch.where(columns < real_cols, grad, 0.0).to(z.dtype)


@torch.library.custom_op("megaformer::ce_grad", mutates_args=())
def ce_grad(
    z: torch.Tensor,
    m: torch.Tensor,
    floor: float,
    scale: torch.Tensor,
    shift: torch.Tensor,
    column: torch.Tensor,
    at_column: torch.Tensor,
    real_cols: int,
) -> torch.Tensor:
    """The loss's gradient over ``z``'s columns, in ``z``'s dtype (see :func:`_grad_math`); the per-row
    operands fp32 (N,) but ``column``, int64 (a row whose target is on another rank has 0 in ``at_column``)."""
    return _run("megaformer::ce_grad", _grad_math, z, m, floor, scale, shift, column, at_column, real_cols)


@ce_grad.register_fake
def _(z, m, floor, scale, shift, column, at_column, real_cols):
    return torch.empty_like(z, memory_format=torch.contiguous_format)
