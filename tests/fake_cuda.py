"""Tensors on a CUDA device in name only, for tests/test_fake_cuda.py: a CUDA build of torch, no GPU, no driver.

Two ways to run megaformer's code with its tensors on ``cuda:0``:

* torch's :class:`FakeTensorMode`: tensors with a shape, a dtype and a device but no values. Every
  op runs its device rules (a CPU tensor mixed with a CUDA one raises
  ``FakeTensorDeviceMismatchError``, as the GPU would), but nothing can read a value: ``.item()``,
  ``bool()`` and ``.tolist()`` raise. The training step reads none, so it runs there as it is.
* :class:`CudaInName`: the same FakeTensorMode decides every op's output devices (the same rules,
  the same errors), and the CPU computes its values. A tensor on ``cuda:0`` is then a
  :class:`NamedCuda`: a FakeTensor (its device, shape, dtype) beside a CPU tensor (its values).
  Code that reads values runs: beam search, validation, checkpoint saves and loads.

:class:`DeviceAudit` is the recording mode laid over either: it sees every op with the tensors as
the code made them and raises on a CPU tensor where there should be none, naming the op and the
line of megaformer that issued it. A 0-dim CPU tensor is allowed where torch allows it, as a
scalar argument of a CUDA kernel (``FakeTensorMode``'s rule, and eager CUDA's).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
PACKAGE = Path(__file__).resolve().parents[1] / "megaformer"
# Copies between the host and the device: the only ops that may hold a CPU tensor beside a CUDA one.
TRANSFERS = frozenset({aten._to_copy.default, aten.copy_.default, aten._copy_from.default})
# Questions about a tensor that compute nothing (beside the prim namespace's: prim.device and the like).
QUERIES = frozenset({aten.is_pinned.default})
# Collectives: nccl takes device tensors only (a barrier's tensor is torch's own).
COLLECTIVES = ("c10d", "_c10d_functional")


def issued_at() -> str:
    """``file:line in function`` of the innermost frame of megaformer's own code (or of the test) in the stack."""
    frame = sys._getframe(1)
    fallback = None
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(PACKAGE):
            return f"{path.relative_to(PACKAGE.parent)}:{frame.f_lineno} in {frame.f_code.co_name}"
        if fallback is None and path.name.startswith("test_"):
            fallback = f"tests/{path.name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return fallback or "outside megaformer"


def _tensors(tree: object) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _on_host(t: torch.Tensor) -> bool:
    """A CPU tensor that is not a 0-dim scalar (which CUDA kernels take as an argument)."""
    return t.device.type == "cpu" and t.dim() > 0


def _describe(tensors: list[torch.Tensor]) -> str:
    return ", ".join(f"{t.device.type}{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tensors)


class DeviceAudit(TorchDispatchMode):
    """Raises on an op whose inputs or outputs hold a CPU tensor (0-dim CPU scalars allowed, as torch allows them).

    A copy from the host to the device (a batch's) passes: it is how data gets there. One
    back to the host raises in the step (it would wait for the device). ``host_allowed``:
    decoding and validation keep their bookkeeping (lengths, finished hypotheses, sums
    read for the log) on the host by design; there an op all on the host passes, and so
    does a copy either way, but an op that mixes a host tensor with a device one still
    raises, as does a collective given a CPU tensor (nccl's rule). ``counts`` tallies the
    ops: ``device``, ``host``, ``to device``, ``to host``, ``collective``.
    """

    def __init__(self, host_allowed: bool = False) -> None:
        super().__init__()
        self.host_allowed = host_allowed
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "prim" or func in QUERIES:
            return func(*args, **kwargs)
        inputs = _tensors((args, kwargs))
        if func.namespace in COLLECTIVES and "barrier" not in func.name():
            if any(t.device.type == "cpu" for t in inputs):
                self._refuse(func, "hands a CPU tensor to a collective (nccl takes device tensors only)", inputs)
            self.counts["collective"] += 1
            return func(*args, **kwargs)
        if func not in TRANSFERS and any(map(_on_host, inputs)) and any(t.device.type != "cpu" for t in inputs):
            self._refuse(func, "mixes a CPU tensor with a device one", inputs)  # before torch's own error, to name it
        out = func(*args, **kwargs)
        self._check(func, inputs, _tensors(out))
        return out

    def _check(self, func, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        tensors = inputs + outputs
        host = [t for t in tensors if _on_host(t)]
        device = [t for t in tensors if t.device.type != "cpu"]
        if not host:
            self.counts["device" if device else "scalars"] += 1
        elif func in TRANSFERS and device:
            target = inputs[0] if func is aten.copy_.default else outputs[0]
            kind = "to device" if target.device.type != "cpu" else "to host"
            if kind == "to host" and not self.host_allowed:
                self._refuse(func, "copies to the host in the step", tensors)
            self.counts[kind] += 1
        elif self.host_allowed and not device:
            self.counts["host"] += 1
        else:
            what = "mixes a CPU tensor with a device one" if device else "makes or uses a CPU tensor in the step"
            self._refuse(func, what, tensors)

    @staticmethod
    def _refuse(func, what: str, tensors: list[torch.Tensor]) -> None:
        raise AssertionError(f"{func} {what} at {issued_at()}: {_describe(tensors)}")


# ---- CUDA in name, values on the CPU ---------------------------------------------------------------


class NamedCuda(torch.Tensor):
    """A tensor on a CUDA device in name: ``fake``, a FakeTensor there, holds its metadata; ``host_values`` its values.

    ``host_values`` is a CPU tensor; the wrapper takes its strides (the CPU kernel's, which
    may differ from the CUDA kernel's that ``fake`` has).
    """

    host_values: torch.Tensor
    fake: torch.Tensor

    @staticmethod
    def __new__(cls, real: torch.Tensor, fake: torch.Tensor) -> NamedCuda:
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            real.shape,
            strides=real.stride(),
            storage_offset=real.storage_offset(),
            dtype=real.dtype,
            device=fake.device,
            requires_grad=False,
        )
        out.host_values, out.fake = real, fake
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        mode = next(t.fake.fake_mode for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, NamedCuda))
        return _run(mode, func, args, kwargs or {})

    def __repr__(self, **_) -> str:
        return f"NamedCuda({self.host_values!r}, device='{self.device}')"


def _cuda(x: object) -> bool:
    return isinstance(x, torch.device) and x.type == "cuda"


def _run(fake_mode: FakeTensorMode, func, args, kwargs):
    """``func`` with FakeTensorMode deciding its output devices and the CPU computing its values."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    if not any(isinstance(x, NamedCuda) or _cuda(x) for x in flat):
        return func(*args, **kwargs)  # all on the host

    def fake_of(x):
        if isinstance(x, NamedCuda):
            return x.fake
        if _cuda(x) and x.index is None:  # the current device, cuda:0 (FakeTensor would ask the driver which)
            return torch.device("cuda", 0)
        return fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x

    def real_of(x):
        if isinstance(x, NamedCuda):
            return x.host_values
        return torch.device("cpu") if _cuda(x) else x

    fake_args, fake_kwargs = pytree.tree_unflatten([fake_of(x) for x in flat], spec)
    try:
        with fake_mode:
            fake_out = func(*fake_args, **fake_kwargs)
    except (DataDependentOutputException, DynamicOutputShapeException):
        fake_out = None  # the values decide the output (.item(), nonzero): the CPU's result gives it
    real_args, real_kwargs = pytree.tree_unflatten([real_of(x) for x in flat], spec)
    real_out = func(*real_args, **real_kwargs)
    from_fake = fake_out is not None  # else the CPU's result decides the outputs' shapes and non-tensor values
    if not from_fake:
        device = _device_of(func, flat)
        with fake_mode:
            fake_out = pytree.tree_map_only(
                torch.Tensor, lambda r: torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device=device), real_out
            )
    originals = {id(real_of(x)): x for x in flat if isinstance(x, torch.Tensor)}

    def wrap(real, fake):
        if not isinstance(real, torch.Tensor):
            return fake if from_fake else real  # a decision of the device (which attention kernel), or a value
        if id(real) in originals:  # in place, or out=: the argument itself
            return originals[id(real)]
        return NamedCuda(real, fake) if fake.device.type != "cpu" else real

    return pytree.tree_map(wrap, real_out, fake_out)


def _device_of(func, flat: list) -> torch.device:
    """The device of a value-dependent op's output: that of its tensors, which must agree (0-dim CPU ones aside)."""
    devices = {x.device for x in flat if isinstance(x, torch.Tensor) and not (x.device.type == "cpu" and x.dim() == 0)}
    if len(devices) > 1:
        raise RuntimeError(f"{func}: tensors on {sorted(map(str, devices))}")
    return devices.pop() if devices else torch.device("cpu")


def _sets_data(func) -> bool:
    """Whether ``func`` is the setter of ``Tensor.data``."""
    return getattr(func, "__self__", None) is torch._C.TensorBase.data and func.__name__ == "__set__"


class _CurrentDevice(TorchFunctionMode):
    """``"cuda"`` without an index is the current device, cuda:0: ``.to("cuda")`` would ask the driver which one.

    Also what torch does for a CUDA tensor above the dispatcher: ``.tolist()`` copies it to the
    host first, ``.numpy()`` refuses it. ``p.data = x`` gives a NamedCuda ``p`` the values of ``x``
    too (torch copies only the metadata of the tensor object).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _sets_data(func) and isinstance(args[0], NamedCuda) and isinstance(args[1], NamedCuda):
            # p.data = p.data.to(bf16), as DeepSpeed and the lean engine cast: torch sets the wrapper's dtype and shape
            func(*args)
            args[0].host_values, args[0].fake = args[1].host_values, args[1].fake
            return None
        if func in (torch.Tensor.tolist, torch.Tensor.numpy) and isinstance(args[0], NamedCuda):
            if func is torch.Tensor.numpy:
                raise TypeError(f"can't convert {args[0].device} device type tensor to numpy (at {issued_at()})")
            return args[0].to("cpu").tolist()

        def index(x):
            if (isinstance(x, str) and x == "cuda") or (_cuda(x) and x.index is None):
                return torch.device("cuda", 0)
            return x

        args, kwargs = pytree.tree_map(index, (args, kwargs or {}))
        return func(*args, **kwargs)


class _NoDriver(FakeTensorMode):
    """FakeTensorMode that never starts the device, even where a test makes ``torch.cuda.is_available()`` say True."""

    @property
    def avoid_device_init(self) -> bool:
        return True


class CudaInName(TorchDispatchMode):
    """Factories and copies to ``cuda`` make :class:`NamedCuda` tensors; their ops run through :func:`_run`."""

    def __init__(self) -> None:
        super().__init__()
        self.fake_mode = _NoDriver()
        self._saved = None
        self._current = _CurrentDevice()

    def __enter__(self):
        # While the mode is on: torch.tensor(data, device="cuda") builds the tensor on the host, then copies it (as
        # under FakeTensorMode); a copy to "cuda" does not start the driver (torch skips that only for
        # FakeTensorMode's own key: torch.cuda._lazy_init, which torch's C++ calls by name, is a no-op); and
        # Module.to("cuda") gives the module new Parameter objects (by default it would set each CPU parameter's
        # .data to its NamedCuda copy, which leaves a CUDA tensor without storage), so module.to("cuda") must come
        # before an optimizer is built over the parameters, as the trainer orders it.
        self._saved = (
            torch._C._only_lift_cpu_tensors(),
            torch.cuda._lazy_init,
            torch.__future__.get_overwrite_module_params_on_conversion(),
        )
        torch._C._set_only_lift_cpu_tensors(True)
        torch.cuda._lazy_init = lambda: None
        torch.__future__.set_overwrite_module_params_on_conversion(True)
        self._current.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        lift, torch.cuda._lazy_init, overwrite = self._saved
        torch._C._set_only_lift_cpu_tensors(lift)
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
        self._current.__exit__(*exc)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _run(self.fake_mode, func, args, kwargs or {})
