"""This CPU's constants for the step's price: its matmul peak, its memory bandwidth, its host time per operator.

* the matmul peak: :func:`megaformer.train.metrics.measured_matmul_peak` (what the Trainer logs MFU against);
* the bandwidth: an element-wise add of tensors of ``bandwidth_bytes`` each, bytes read and written per second;
* the host's time per operator: the real step (:func:`megaformer.sim.step.run_step`) of the config
  at the smallest width its heads allow (4 dimensions a head, a 128-piece vocabulary, micro-batches
  of 2 sentences of 4 tokens), on real CPU tensors and one thread, so that its kernels cost next to
  nothing: the median step time over the operators it dispatches. This is Python, autograd, the
  dispatcher and the optimizer's loops as this CPU runs them; a GPU's host adds its launches
  (:data:`megaformer.sim.roofline.GPUS`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from megaformer.config import Config
from megaformer.sim.roofline import Device
from megaformer.sim.step import MicroShape, run_step
from megaformer.train.metrics import measured_matmul_peak


def memory_bandwidth(nbytes: int = 8 << 20, repeats: int = 20) -> float:
    """Bytes read and written per second by ``c = a + b`` on fp32 tensors of ``nbytes`` (the median of ``repeats``)."""
    n = nbytes // 4
    a, b, c = torch.rand(n), torch.rand(n), torch.empty(n)
    torch.add(a, b, out=c)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        torch.add(a, b, out=c)
        times.append(time.perf_counter() - began)
    return 3 * nbytes / statistics.median(times)


def narrowest(cfg: Config) -> Config:
    """``cfg`` at the smallest width its heads allow: its depth, step plan and code paths, kernels that cost nothing."""
    m = cfg.model
    model = dataclasses.replace(m, d_model=4 * m.num_heads, d_ff=16)
    return dataclasses.replace(cfg, model=model, data=dataclasses.replace(cfg.data, vocab_size=128))


def host_seconds_per_op(cfg: Config, micro_batches: int, steps: int = 5) -> float:
    """The host's time per dispatched operator: the real step of :func:`narrowest` ``cfg`` on this CPU."""
    small = narrowest(cfg)
    shapes = [MicroShape(2, 4, 4)] * micro_batches
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a host dispatches on one thread; tiny kernels gain nothing from a second
    try:
        seconds, ops = run_step(small, shapes, steps=steps)
    finally:
        torch.set_num_threads(threads)
    return seconds / ops


def cpu_device(cfg: Config, micro_batches: int, bandwidth_bytes: int = 8 << 20) -> Device:
    """This CPU as a :class:`Device`: measured peaks and bandwidth, the host's time per operator, no overlap."""
    low = measured_matmul_peak(torch.bfloat16) if cfg.train.precision == "bf16" else 0.0
    return Device(
        "this CPU",
        peak_low=low or 1.0,
        peak_fp32=measured_matmul_peak(torch.float32),
        bandwidth=memory_bandwidth(bandwidth_bytes),
        gemm_efficiency=1.0,  # the peaks are measured, not a datasheet's
        memory_efficiency=1.0,
        min_kernel_s=0.0,
        host_op_s=host_seconds_per_op(cfg, micro_batches),
        overlap=False,
    )
