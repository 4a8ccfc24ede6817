"""Recording a step's aten operators: FLOPs, bytes, kernels and host reads, on tensors that hold no data.

The step runs on the ``meta`` device (the GPU simulation) or under ``FakeTensorMode`` on the
CPU (the CPU's own prediction): every operator's shapes, dtypes and order are the real
code's, nothing is computed. :class:`OpRecorder` is a ``TorchDispatchMode`` that writes one
:class:`Op` per aten operator:

* **FLOPs** from torch's own formulas (``torch.utils.flop_counter``: matmuls and attention);
* **bytes** read and written: every tensor input and output, each counted over the memory
  it spans (a broadcast input once, not once per use), with no credit for caches; a gather
  (``gather``, ``embedding``, ``index_select``) reads of its source only what it writes;
* **kernels**: 0 for views and allocations, 1 for an operator, and for the foreach and
  fused optimizer operators the launches CUDA's ``multi_tensor_apply`` makes;
* **host reads**: ``item`` / ``tolist`` of a device value (``_local_scalar_dense``) and copies
  from the device to the host, each a wait for every kernel queued before it on a GPU;
* **new bytes**: the storages it makes (a CPU pays for the first touch of a large one: see
  :class:`megaformer.sim.roofline.Device`).

Why the meta device and not fake CUDA tensors for the GPU: with torch's CUDA build and no
driver, the autograd engine refuses a backward over fake CUDA tensors
("hasPrimaryContext expects a valid device index"). The meta device runs backward, and the
code's device branches take their GPU form on it (they test ``device.type == "cpu"``). What
the meta device cannot do as CUDA does is pick SDPA's fused kernel: :class:`FusedAttention`
calls the kernel CUDA would run (efficient attention with a mask, flash without), whose meta
forms exist, so the record holds that kernel and its backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten

# Operators that make no kernel: views, metadata and allocations (their host cost still counts).
NO_KERNEL = {
    "view", "_unsafe_view", "reshape", "_reshape_alias", "transpose", "t", "permute", "expand", "slice", "select",
    "unsqueeze", "squeeze", "as_strided", "detach", "alias", "split", "split_with_sizes", "unbind", "narrow",
    "chunk", "diagonal", "unflatten", "lift_fresh", "empty", "empty_strided", "empty_like", "new_empty",
    "new_empty_strided", "set_", "resize_", "_local_scalar_dense", "is_nonzero", "sym_size", "sym_stride",
    "sym_numel", "sym_storage_offset", "_to_copy_meta", "view_as", "expand_as", "movedim", "flatten",
    "_has_compatible_shallow_copy_type", "is_same_size", "record_stream", "_unsafe_index_put_meta",
}  # fmt: skip
GEMMS = {
    "mm", "bmm", "addmm", "baddbmm", "_scaled_mm", "_efficient_attention_forward", "_efficient_attention_backward",
    "_flash_attention_forward", "_flash_attention_backward", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_cudnn_attention_backward", "_linear_pointwise",
}  # fmt: skip
GATHERS = {"gather", "embedding", "index_select"}  # their first input is read only where indexed
# CUDA's multi_tensor_apply: at most this many tensors a launch by the number of lists, and 320 blocks
# of 65,536 elements.
_MTA_TENSORS = {1: 110, 2: 64, 3: 48, 4: 36, 5: 30}
_MTA_ELEMENTS = 320 * 65536


@dataclass
class Op:
    """One aten operator of a recorded step."""

    name: str  # e.g. "mm", "add_", "_fused_adam_"
    flops: float
    bytes: float  # read + written, no cache credit
    kernels: int  # launches on a GPU (0: a view or an allocation)
    host_read: bool  # the host waits for the device here
    gemm: bool  # priced at the matmul peak (else at the memory bandwidth)
    on_device: bool  # run on the simulated device (False: host-side tensors, e.g. a batch being built)
    dtype: str  # the widest floating dtype among its tensors ("" if none)
    phase: str = ""  # the step's part it belongs to (forward, backward, optimizer, ...)
    host_s: float = 0.0  # host time of its own beside the per-operator dispatch (modelled Python work)
    signature: tuple = ()  # (operator, its arguments with each tensor as a TensorSpec): to time it again on a CPU
    new_bytes: float = 0.0  # the bytes of the storages it makes (outputs that are no input's storage or view)


def _extent_bytes(t: torch.Tensor) -> int:
    """The bytes a tensor's elements span: a broadcast (stride 0) dimension counts once."""
    if t.numel() == 0:
        return 0
    span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()) if size > 1)
    return min(span, t.numel()) * t.element_size()


def _tensors(tree) -> list[torch.Tensor]:
    """The tensors in ``tree`` (nested lists, tuples, dicts), in order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []


@dataclass(frozen=True)
class TensorSpec:
    """A tensor argument by its layout: what :func:`megaformer.sim.calibrate.op_seconds` makes again to time it."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype

    def make(self) -> torch.Tensor:
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype)
        return t.uniform_() if t.is_floating_point() else t.zero_()  # integer indices 0: valid for any gather


def _spec(tree):
    """``tree`` with each tensor replaced by its :class:`TensorSpec`, lists by tuples (hashable)."""
    if isinstance(tree, torch.Tensor):
        return TensorSpec(tuple(tree.shape), tuple(tree.stride()), tree.dtype)
    if isinstance(tree, (list, tuple)):
        return tuple(_spec(item) for item in tree)
    if isinstance(tree, dict):
        return tuple(sorted((key, _spec(value)) for key, value in tree.items()))
    return tree


def made_again(tree):
    """The arguments :func:`_spec` described, with new tensors (lists as lists, keyword pairs as a dict)."""
    if isinstance(tree, TensorSpec):
        return tree.make()
    if isinstance(tree, tuple):
        return [made_again(item) for item in tree]
    return tree


def _foreach_kernels(name: str, args: tuple, device: str) -> int:
    """Launches of a foreach or fused optimizer operator: CUDA's multi_tensor_apply groups its tensors; a CPU
    runs a foreach operator as one operator per tensor (its fused Adam as one)."""
    lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
    if not lists:
        return 1
    if device == "cpu":
        return 1 if name.startswith("_fused") else len(lists[0])
    tensors, elements = len(lists[0]), sum(t.numel() for t in lists[0])
    per_launch = _MTA_TENSORS.get(len(lists), 30)
    return max(math.ceil(tensors / per_launch), math.ceil(elements / _MTA_ELEMENTS), 1)


def _widest_float(tensors: list[torch.Tensor]) -> str:
    floats = [t.dtype for t in tensors if t.is_floating_point()]
    if not floats:
        return ""
    return str(max(floats, key=lambda d: torch.finfo(d).bits)).removeprefix("torch.")


class OpRecorder(TorchDispatchMode):
    """Writes an :class:`Op` for every aten operator dispatched inside it (see the module docstring).

    ``device``: the simulated device's type ("meta" or "cpu"); ops on other devices are the
    host's. ``phase`` is set by the caller around each part of the step.
    """

    def __init__(self, device: str, signatures: bool = False) -> None:
        super().__init__()
        self.device = device
        self.signatures = signatures  # keep each kernel's operator and arguments (to time it again on a CPU)
        self.ops: list[Op] = []
        self.phase = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = self._read_meta(func, args, kwargs)
        if out is None:
            out = func(*args, **kwargs)
        if func.namespace != "prim":  # a fake tensor's ``.device`` is dispatched (prim.device); a real one's is not
            self.ops.append(self.describe(func, args, kwargs, out))
        return out

    def _read_meta(self, func, args: tuple, kwargs: dict):
        """A meta or fake tensor read by the host holds no value: zeros of its shape on the host (None: not such
        a read, or a real tensor's)."""
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if source is None or not (source.device.type == "meta" or isinstance(source, FakeTensor)):
            return None
        if func is aten._local_scalar_dense.default:
            return False if source.dtype == torch.bool else 0
        if source.device.type == "meta" and func is aten._to_copy.default and str(kwargs.get("device")) == "cpu":
            return torch.zeros(source.shape, dtype=kwargs.get("dtype") or source.dtype, device="cpu")
        return None

    def describe(self, func, args: tuple, kwargs: dict, out) -> Op:
        name = func._overloadpacket.__name__
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        tensors = inputs + outputs
        on_device = any(t.device.type == self.device for t in tensors)
        to_host = name in ("_to_copy", "copy_") and any(t.device.type == "cpu" for t in outputs[:1])
        host_read = name in ("_local_scalar_dense", "is_nonzero") or (on_device and to_host and self.device != "cpu")
        if name in ("_local_scalar_dense", "is_nonzero"):
            on_device = bool(inputs) and inputs[0].device.type == self.device
            host_read = on_device
        flops = 0.0
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            flops = float(formula(*args, **kwargs, out_val=out))
        elif name == "_linear_pointwise":  # oneDNN's linear (parallel/cpu_matmul.py), which torch has no formula for
            flops = 2.0 * outputs[0].numel() * inputs[0].shape[-1]
        if name in NO_KERNEL or not on_device or not (outputs or name.endswith("_")):  # no tensor made or changed
            kernels, nbytes = 0, 0
        elif name in GATHERS:  # reads only the rows or elements it gathers: as many as it writes, and the indices
            kernels = 1
            nbytes = sum(2 * _extent_bytes(t) for t in outputs) + sum(_extent_bytes(t) for t in inputs[1:])
        else:
            kernels = _foreach_kernels(name, args, self.device) if name.startswith(("_foreach", "_fused")) else 1
            nbytes = sum(_extent_bytes(t) for t in tensors if t.device.type == self.device or name == "_to_copy")
        gemm = name in GEMMS
        signature = (func, _spec(args), _spec(kwargs)) if self.signatures and kernels else ()
        dtype = _widest_float(tensors)
        made = _new_storage_bytes(inputs, outputs) if on_device else 0
        return Op(name, flops, nbytes, kernels, host_read, gemm, on_device, dtype, self.phase, 0.0, signature, made)


def _new_storage_bytes(inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> int:
    """The bytes of the storages among ``outputs`` that no input holds (an in-place result or a view makes none)."""
    held = {t.untyped_storage()._cdata for t in inputs}
    made: dict[int, int] = {}
    for t in outputs:
        storage = t.untyped_storage()
        if storage._cdata not in held:
            made[storage._cdata] = storage.nbytes()
    return sum(made.values())


class _FusedAttentionFn(torch.autograd.Function):
    """SDPA as CUDA runs it: one fused kernel forward, one backward (efficient with a mask, flash without)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, causal: bool, scale):
        if bias is None:
            out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, causal, False, scale=scale
            )
            ctx.flash = (cum_q, cum_k, max_q, max_k, seed, offset)
        else:
            out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
                q, k, v, bias, True, 0.0, causal, scale=scale
            )
            ctx.flash = None
            ctx.seeds = (seed, offset)
        ctx.causal, ctx.scale = causal, scale
        ctx.save_for_backward(q, k, v, bias, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, bias, out, lse = ctx.saved_tensors
        if ctx.flash is not None:
            cum_q, cum_k, max_q, max_k, seed, offset = ctx.flash
            dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, ctx.causal, seed, offset, scale=ctx.scale
            )
        else:
            seed, offset = ctx.seeds
            dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
                grad, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False], ctx.causal, scale=ctx.scale
            )
        return dq, dk, dv, None, None, None


class FusedAttention(TorchFunctionMode):
    """Inside it, ``F.scaled_dot_product_attention`` on the meta device runs the kernel CUDA would pick.

    A boolean mask becomes the additive bias the efficient kernel reads (0 or -inf, in the
    queries' dtype, broadcast to (batch, heads, tgt_len, src_len)).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        causal = kwargs.get("is_causal", False)
        bias = None
        if mask is not None:
            shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).expand(shape)
        return _FusedAttentionFn.apply(q, k, v, bias, causal, kwargs.get("scale"))
