"""Pricing a recorded step on a device: a roofline per operator, a host that dispatches, and their timeline.

Each operator costs the device ``max(FLOPs / (peak x gemm_efficiency), bytes / (bandwidth x
memory_efficiency), launches x min_kernel_s)``: a matmul at most ``gemm_efficiency`` of the dense
peak, anything else at most ``memory_efficiency`` of the memory bandwidth, and no kernel
shorter than ``min_kernel_s``. The host spends ``host_op_s`` on every operator it dispatches
(Python, autograd and the dispatcher, measured on a CPU: :func:`megaformer.sim.calibrate`)
and ``launch_s`` on every kernel launch.

A CPU's allocator (glibc) maps a storage of ``fresh_min_bytes`` or more anew from the kernel each
time and returns it when freed, so its first touch page-faults: ``fresh_s_per_byte`` more (a GPU's
caching allocator keeps its memory: 0). A kernel timed again on the CPU made its outputs itself, so
only an operator whose time is not measured (an allocation, a modelled one) adds it.

On a GPU the two run side by side: the device starts a kernel once the host has queued it
and the kernel before it is done, and a host read of a device value (``item``, a copy to the
host) makes the host wait until the device has finished everything queued (:func:`timeline`).
On a CPU (``overlap=False``) they are one thread: the step is the sum of both.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from megaformer.sim.ops import Op

LOW_PRECISION = ("bfloat16", "float16")


@dataclass(frozen=True)
class Device:
    """What a step costs on a device. Peaks in FLOP/s, bandwidth in bytes/s, times in seconds."""

    name: str
    peak_low: float  # dense bf16/fp16 matmuls
    peak_fp32: float  # fp32 matmuls (TF32 on a GPU, which megaformer enables for fp32 runs)
    bandwidth: float
    gemm_efficiency: float = 0.7
    memory_efficiency: float = 0.8
    min_kernel_s: float = 4e-6
    launch_s: float = 0.0  # host time per kernel launch (CUDA's launch call), beside host_op_s
    host_op_s: float = 20e-6  # host time per dispatched operator
    overlap: bool = True  # host and device run side by side (False: one CPU thread does both)
    # A CPU's own figures: each kernel's measured seconds by its signature, and (bytes, bytes/s) of an
    # element-wise pass at growing sizes (its caches make small passes faster than its memory)
    measured_seconds: dict = field(default_factory=dict, compare=False)
    bandwidth_by_size: tuple = ()
    fresh_min_bytes: float = float("inf")  # a storage this large is new memory from the kernel each time
    fresh_s_per_byte: float = 0.0  # its first touch (page faults)

    def with_host(self, host_op_s: float) -> Device:
        return replace(self, host_op_s=host_op_s)

    def device_seconds(self, op: Op) -> float:
        if op.signature and op.signature in self.measured_seconds:
            return self.measured_seconds[op.signature]
        fresh = op.new_bytes * self.fresh_s_per_byte if op.new_bytes >= self.fresh_min_bytes else 0.0
        if not op.kernels:
            return fresh
        peak = self.peak_low if op.dtype in LOW_PRECISION else self.peak_fp32
        compute = op.flops / (peak * self.gemm_efficiency) if op.gemm else 0.0
        memory = op.bytes / (self._bandwidth(op.bytes) * self.memory_efficiency)
        return max(compute, memory, op.kernels * self.min_kernel_s) + fresh

    def _bandwidth(self, nbytes: float) -> float:
        """The bandwidth of a pass of ``nbytes``: that measured at the nearest size at or above it, else the last."""
        for size, rate in self.bandwidth_by_size:
            if nbytes <= size:
                return rate
        return self.bandwidth

    def host_seconds(self, op: Op) -> float:
        """The host's time for ``op``: its dispatch (a CPU's foreach operator dispatches one per tensor), its
        launches, its own modelled work."""
        dispatches = op.kernels if not self.overlap and op.name.startswith("_foreach") else 1
        return dispatches * self.host_op_s + op.kernels * self.launch_s + op.host_s


# The datasheets' dense figures (NVIDIA H200 and H100 SXM): bf16 989 TFLOP/s, TF32 494.7; HBM3e 4.8 TB/s,
# HBM3 3.35 TB/s. A CUDA kernel costs the host ~5 us beside the dispatch a CPU operator costs: choosing
# the library's kernel and its workspace (1-5 us) and cudaLaunchKernel (1-3 us on CUDA 12 drivers).
GPUS = {
    "h200": Device("NVIDIA H200", 989e12, 494.7e12, 4.8e12, launch_s=5e-6),
    "h100": Device("NVIDIA H100 SXM", 989e12, 494.7e12, 3.35e12, launch_s=5e-6),
}


@dataclass
class StepCost:
    """A priced step."""

    seconds: float
    device_seconds: float  # the device's busy time
    host_seconds: float  # the host's dispatching time (waits excluded)
    kernels: int
    bytes: float
    flops: float
    host_reads: int
    ops: int
    by_op: dict[str, dict]  # name -> {"seconds", "count", "bytes", "flops"}, device time per operator name


def timeline(ops: list[Op], device: Device) -> StepCost:
    """Price ``ops`` on ``device``: see the module docstring."""
    host = busy = end = 0.0
    dev_total = host_total = 0.0
    by_op: dict[str, dict] = {}
    for op in ops:
        h = device.host_seconds(op)
        d = device.device_seconds(op) if op.on_device else 0.0
        host += h
        host_total += h
        if not device.overlap:
            host += d
        elif op.kernels and op.on_device:
            end = max(end, host) + d
        busy += d
        dev_total += d
        if op.host_read and device.overlap:
            host = max(host, end)
        if d:
            row = by_op.setdefault(op.name, {"seconds": 0.0, "count": 0, "bytes": 0.0, "flops": 0.0})
            row["seconds"] += d
            row["count"] += 1
            row["bytes"] += op.bytes
            row["flops"] += op.flops
    seconds = max(host, end)
    on_device = [op for op in ops if op.on_device]
    return StepCost(
        seconds=seconds,
        device_seconds=dev_total,
        host_seconds=host_total,
        kernels=sum(op.kernels for op in on_device),
        bytes=sum(op.bytes for op in on_device),
        flops=sum(op.flops for op in on_device),
        host_reads=sum(op.host_read for op in ops),
        ops=len(ops),
        by_op=by_op,
    )
