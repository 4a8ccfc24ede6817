"""This CPU's constants for the step's price: its matmul peak, its memory bandwidth, its host time per operator.

* each kernel of the step made again and timed at its own shapes, strides and dtypes: a CPU's small matmuls
  run far below its peak, and its element-wise kernels below its bandwidth (a softmax over rows of 12 keys
  took 8.6 ns an element on the 2-core EPYC: per-row work, not memory), each after its inputs have left
  L2 (other kernels ran in between in the step). A matmul streams its weights (and writes their gradients) from memory when the model's weights exceed the
  last-level cache (on the 2-core EPYC, transformer_base's mm ran 20 % slower in its step than made again
  and timed hot): it is then timed with the cache emptied first, the median of its repeats;
* the bandwidth of an element-wise add at sizes from 48 KiB to 192 MiB, for a kernel that cannot be made again;
* the first touch of new memory: glibc maps a storage of 32 MiB or more (its largest mmap threshold) from the
  kernel at every allocation and unmaps it when freed, so writing it page-faults (0.4 ms a MiB on the EPYC,
  ~12x a write to memory already mapped: DeepSpeed's flat gradient buckets at dp > 1);
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
from pathlib import Path

import torch

from megaformer.config import Config
from megaformer.sim.ops import GEMMS, Op, made_again
from megaformer.sim.roofline import Device
from megaformer.sim.step import MicroShape, run_step
from megaformer.train.metrics import measured_matmul_peak

GLIBC_MMAP_MAX = 32 << 20  # glibc's mmap threshold grows with the chunks freed, to at most this on 64 bits


def memory_bandwidth(nbytes: int = 8 << 20, repeats: int = 20) -> float:
    """Bytes read and written per second by ``c = a + b`` on fp32 tensors of ``nbytes`` (the quickest of ``repeats``)."""
    n = max(1, nbytes // 4)
    a, b, c = torch.rand(n), torch.rand(n), torch.empty(n)
    torch.add(a, b, out=c)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        torch.add(a, b, out=c)
        times.append(time.perf_counter() - began)
    return 3 * 4 * n / min(times)


def bandwidth_by_size(largest: int = 64 << 20) -> tuple[tuple[int, float], ...]:
    """(bytes moved, bytes/s) of an element-wise pass from 48 KiB to ``largest`` x 3, by factors of 4."""
    sizes, size = [], 16 << 10
    while size <= largest:
        sizes.append(size)
        size *= 4
    return tuple((3 * size, memory_bandwidth(size, repeats=max(5, (64 << 20) // size))) for size in sizes)


def cache_bytes(level: int = 3) -> int:
    """Bytes of one of this CPU's caches (sysfs; 32 MiB for the last level, 1 MiB for L2, if it does not say)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if int((index / "level").read_text()) != level or (index / "type").read_text().strip() == "Instruction":
                continue
            text = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
    return (32 if level >= 3 else 1) << 20


def last_level_cache() -> int:
    """Bytes of this CPU's last-level cache."""
    return cache_bytes(3)


def _made(ops: list[Op]) -> dict[tuple, tuple]:
    """Each distinct kernel of ``ops`` made again (those whose arguments' values matter are left out)."""
    calls: dict[tuple, tuple] = {}
    for op in ops:
        if op.signature and op.signature not in calls:
            func, args, kwargs = op.signature
            try:
                made = (made_again(args), {k: made_again(v) for k, v in kwargs})
                func(*made[0], **made[1])
            except Exception:  # noqa: BLE001 - a value-dependent operator: priced by the roofline instead
                continue
            calls[op.signature] = (func, *made)
    return calls


def op_seconds(ops: list[Op], repeats: int = 3, rounds: int = 2, cold_gemms: bool = False) -> dict[tuple, float]:
    """Each distinct kernel of ``ops`` (operator and argument layouts) made again and timed on this CPU: the
    quickest of ``repeats`` calls after an untimed one, in each of ``rounds`` sweeps over them all (a burst of
    another process's work on the cores then spoils one sweep's figure, not the kernel's). An operator that
    cannot be made again (its arguments' values matter) is left out, and the roofline prices it.

    Before each call twice the L2 cache is written: in a step a kernel's inputs were written by other
    kernels since it last ran, and it finds them beyond L2 (timed hot, tiny's kernels summed 5 % under
    the same kernels after a sweep, on the 2-core EPYC). ``cold_gemms``: a matmul is timed after
    reading twice the last-level cache, the median of its calls (its weights come from memory, as in
    a step whose weights the cache cannot hold)."""
    calls = _made(ops)
    l2 = torch.empty(2 * cache_bytes(2) // 4).uniform_()
    sweep = torch.empty(2 * last_level_cache() // 4).uniform_() if cold_gemms else None
    cold = {signature for signature in calls if sweep is not None and signature[0]._overloadpacket.__name__ in GEMMS}
    timed: dict[tuple, list[float]] = {}
    for _ in range(rounds):
        for signature, (func, args, kwargs) in calls.items():
            for _ in range(repeats):
                if signature in cold:
                    sweep.sum()
                else:
                    l2.add_(1.0)
                began = time.perf_counter()
                func(*args, **kwargs)
                timed.setdefault(signature, []).append(time.perf_counter() - began)
    return {signature: (statistics.median if signature in cold else min)(times) for signature, times in timed.items()}


def fresh_memory_cost(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Seconds a byte to write a new ``nbytes`` storage beyond writing one already mapped (the quickest of
    ``repeats``): the page faults of memory glibc maps anew (see the module docstring)."""

    def quickest(make) -> float:
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            make().fill_(1.0)
            times.append(time.perf_counter() - began)
        return min(times)

    kept = torch.empty(nbytes // 4)
    return max(0.0, quickest(lambda: torch.empty(nbytes // 4)) - quickest(lambda: kept)) / nbytes


def narrowest(cfg: Config) -> Config:
    """``cfg`` at the smallest width its heads allow: its depth, step plan and code paths, kernels that cost nothing."""
    m = cfg.model
    model = dataclasses.replace(m, d_model=4 * m.num_heads, d_ff=16)
    return dataclasses.replace(cfg, model=model, data=dataclasses.replace(cfg.data, vocab_size=128))


def host_seconds_per_op(cfg: Config, micro_batches: int, steps: int = 5, builds: int = 3) -> float:
    """The host's time per dispatched operator: the real step of :func:`narrowest` ``cfg`` on this CPU, the
    median over ``builds`` models built anew of each one's quickest step (one build's figure moved 9-17 us an
    operator from build to build on the 2-core EPYC, the machine otherwise idle)."""
    small = narrowest(cfg)
    shapes = [MicroShape(2, 4, 4)] * micro_batches
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a host dispatches on one thread; tiny kernels gain nothing from a second
    try:
        figures = []
        for _ in range(builds):
            seconds, ops = run_step(small, shapes, steps=steps)
            figures.append(seconds / ops)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(figures)


def cpu_device(cfg: Config, micro_batches: int, ops: list[Op] = (), weight_bytes: int = 0) -> Device:
    """This CPU as a :class:`Device`: the kernels of ``ops`` timed (matmuls cold where ``weight_bytes``, the
    model's weights, exceed the last-level cache), its bandwidth by size, the host's time per operator, the
    first touch of new memory, no overlap (one thread dispatches and computes)."""
    low = measured_matmul_peak(torch.bfloat16) if cfg.train.precision == "bf16" else 0.0
    by_size = bandwidth_by_size()
    return Device(
        "this CPU",
        peak_low=low or 1.0,
        peak_fp32=measured_matmul_peak(torch.float32),
        bandwidth=by_size[-1][1],
        gemm_efficiency=1.0,  # measured figures, not a datasheet's
        memory_efficiency=1.0,
        min_kernel_s=0.0,
        host_op_s=host_seconds_per_op(cfg, micro_batches),
        overlap=False,
        measured_seconds=op_seconds(list(ops), cold_gemms=weight_bytes > last_level_cache()),
        bandwidth_by_size=by_size,
        fresh_min_bytes=GLIBC_MMAP_MAX,
        fresh_s_per_byte=fresh_memory_cost(),
    )
