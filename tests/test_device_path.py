"""The GPU path's host side, checked on a CPU: MFU peaks, TF32 set-up, pinned batches and async copies."""

import math
from pathlib import Path

import pytest
import torch

from megaformer import cli
from megaformer.data.stream import Batch, TokenBatchStream
from megaformer.train.device import configure_math
from megaformer.train.metrics import device_peak_flops, gpu_peak_tflops


@pytest.mark.parametrize(
    "name, precision, tflops",
    [
        ("NVIDIA H200", "bf16", 989.0),  # the figure
        ("NVIDIA H100 80GB HBM3", "bf16", 989.0),
        ("NVIDIA H100 80GB HBM3", "fp32", 494.0),  # TF32 (configure_math); 67 without it
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H200 NVL", "fp16", 835.0),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),  # not A10's 125
        ("NVIDIA A100-SXM4-80GB", "fp32", 156.0),
        ("NVIDIA A10", "bf16", 125.0),
        ("NVIDIA L40S", "bf16", 362.0),
        ("NVIDIA L4", "bf16", 121.0),
        ("Tesla V100-SXM2-32GB", "fp32", 15.7),  # no TF32
    ],
)
def test_gpu_peak_table(name, precision, tflops):
    assert gpu_peak_tflops(name, precision) == tflops


def test_gpu_peak_without_tf32_and_unknown():
    assert gpu_peak_tflops("NVIDIA H200", "fp32", tf32=False) == 67.0
    assert math.isnan(gpu_peak_tflops("Tesla V100-SXM2-32GB", "bf16"))
    assert math.isnan(gpu_peak_tflops("Some Future GPU", "bf16"))


@pytest.fixture
def matmul_precision():
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


def test_device_peak_reads_the_name_and_the_tf32_setting(monkeypatch, matmul_precision):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    cuda = torch.device("cuda", 0)
    assert device_peak_flops(cuda, "bf16") == 989e12
    assert device_peak_flops(cuda, "fp32", 100.0) == 100e12  # train.peak_tflops wins
    torch.set_float32_matmul_precision("highest")
    assert device_peak_flops(cuda, "fp32") == 67e12
    configure_math(cuda, "fp32")
    assert device_peak_flops(cuda, "fp32") == 494e12


def test_configure_math_sets_tf32_only_for_fp32_on_cuda(monkeypatch, matmul_precision):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    torch.set_float32_matmul_precision("highest")
    configure_math(torch.device("cpu"), "fp32")
    assert torch.get_float32_matmul_precision() == "highest"
    configure_math(torch.device("cuda", 0), "bf16")
    assert torch.get_float32_matmul_precision() == "highest"
    assert "TF32" in configure_math(torch.device("cuda", 0), "fp32")
    assert torch.get_float32_matmul_precision() == "high"


def test_pinned_stream_pins_every_batch_and_copies_without_blocking(tmp_path, monkeypatch):
    out = tmp_path / "data"
    assert cli.main(["prepare", "--synthetic", "300", "--out", str(out), "--quiet"]) == 0
    pinned = []  # a CPU-only torch cannot pin: record the calls instead
    monkeypatch.setattr(Batch, "pin_memory", lambda self: pinned.append(self) or self)
    stream = TokenBatchStream(out, "train", dp_rank=0, dp_size=1, max_tokens=256, pin_memory=True, repeat=False)
    plain = TokenBatchStream(out, "train", dp_rank=0, dp_size=1, max_tokens=256, repeat=False)
    batches = list(stream)
    assert pinned == batches and len(batches) > 1
    assert all(torch.equal(a.src, b.src) and torch.equal(a.tgt_out, b.tgt_out) for a, b in zip(batches, plain))

    copies = []
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: True)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, device, non_blocking=False: copies.append(non_blocking))
    batches[0].to(torch.device("cuda", 0))
    assert copies and all(copies)  # pinned -> asynchronous copies to a GPU
    copies.clear()
    batches[0].to("cpu")
    assert copies and not any(copies)


def test_native_bf16_is_read_from_the_cpu_flags_and_onednns_isa_cap(tmp_path, monkeypatch):
    from megaformer.train.device import cpu_bf16_missing

    def cpuinfo(flags: str) -> Path:
        path = tmp_path / f"cpuinfo-{len(flags)}"
        path.write_text(f"processor\t: 0\nflags\t\t: fpu {flags}\n\nprocessor\t: 1\nflags\t\t: fpu {flags}\n")
        return path

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert cpu_bf16_missing(cpuinfo("avx2 fma avx512f avx512_bf16")) is None
    assert cpu_bf16_missing(cpuinfo("avx2 fma amx_bf16 amx_tile")) is None
    assert "it has avx2" in cpu_bf16_missing(cpuinfo("avx2 fma"))
    assert "it has avx512f" in cpu_bf16_missing(cpuinfo("avx2 avx512f"))
    assert "no native bf16" in cpu_bf16_missing(tmp_path / "no-such-file")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in cpu_bf16_missing(cpuinfo("avx2 fma avx512f avx512_bf16"))


def test_the_cpu_matmul_peak_stops_growing_once_a_matmul_is_slow(monkeypatch):
    """An emulated dtype is measured on a small matmul (bf16 at 1024 took 16 s per rank on AVX2)."""
    import time

    from megaformer.train import metrics

    sizes = []
    real = torch.randn

    def recording(n, m, dtype):
        sizes.append(n)
        return real(n, m, dtype=dtype)

    monkeypatch.setattr(metrics.torch, "randn", recording)
    clock = iter(range(1000))  # every perf_counter call one second later: the first matmul is already slow
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: float(next(clock)))
    assert metrics.measured_matmul_peak(torch.float32) == 2 * 128**3  # one second per matmul
    assert sizes == [128, 128]
    monkeypatch.setattr(metrics.time, "perf_counter", time.perf_counter)
    sizes.clear()
    assert metrics.measured_matmul_peak(torch.float32, n=256, slow=1e9) > 0
    assert sizes == [128, 128, 256, 256]


def test_the_cpu_matmul_peak_looks_past_a_burst_of_other_work(monkeypatch):
    """A core taken by other work for the first 100 ms (a rank's helper threads at start) does not lower the peak.

    The median of five such matmuls measured the burst: one rank in three starts logged a third of its MFU.
    """
    from megaformer.train import metrics

    now = [0.0]  # the measurement's clock, moved by the matmuls alone: slept, a loaded machine's 1 ms took 3

    class Operand:
        def __matmul__(self, other):
            now[0] += 0.01 if now[0] < 0.1 else 0.001

    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(metrics.torch, "randn", lambda n, m, dtype: Operand())
    monkeypatch.setattr(metrics, "linear", lambda a, b: a @ b)  # the operands' own product
    assert metrics.measured_matmul_peak(torch.float32, n=128) > 2 * 128**3 / 0.003  # ~1 ms a matmul, not 10


def test_bf16_on_a_cpu_without_it_says_fp32_is_faster(monkeypatch):
    from megaformer.train import device

    monkeypatch.setattr(device, "cpu_bf16_missing", lambda: "this CPU has no native bf16 (test)")
    said = device.configure_math(torch.device("cpu"), "bf16")
    assert "emulated: this CPU has no native bf16 (test)" in said and "train.precision=fp32" in said
    assert device.configure_math(torch.device("cpu"), "fp32") == "fp32 matmuls on cpu"


@pytest.mark.parametrize(
    "slow",
    [
        lambda n, before: n not in before,  # a kernel's set-up: the first call at each size
        lambda n, before: before == [128],  # the first timed matmul lost the core (a peak 1,000x too low hid every MFU)
    ],
    ids=["cold first call", "one matmul that lost the core"],
)
def test_the_matmul_peak_does_not_stop_growing_on_one_slow_matmul(monkeypatch, slow):
    """One matmul 50 ms slow is not the matmul's time: the size grows to n all the same."""
    import time

    from megaformer.train import metrics

    calls: list[int] = []

    class Operand:
        def __init__(self, n):
            self.n = n

        def __matmul__(self, other):
            time.sleep(0.05 if slow(self.n, calls) else 0.0)
            calls.append(self.n)

    monkeypatch.setattr(metrics.torch, "randn", lambda n, m, dtype: Operand(n))
    monkeypatch.setattr(metrics, "linear", lambda a, b: a @ b)  # the operands' own product
    assert metrics.measured_matmul_peak(torch.float32, n=1024) > 0
    assert sorted(set(calls)) == [128, 256, 512, 1024], calls


def test_an_mfu_beyond_the_peak_is_not_shown_and_said_once():
    """A CPU peak timed while other work held the cores gave an MFU of 145 %: not a figure to show."""
    from megaformer.train.metrics import Peak

    said: list[str] = []
    peak = Peak(2e9, "a matmul timed at start-up; train.peak_tflops sets it", 2)
    assert peak.describe() == (
        "MFU against 0.002 TFLOP/s, the peak of 2 ranks (a matmul timed at start-up; train.peak_tflops sets it)"
    )
    assert peak.mfu(1e9, said.append) == 0.5 and said == []
    assert peak.mfu(3e9, said.append) is None and peak.mfu(4e9, said.append) is None
    assert len(said) == 1 and "computes 0.003 TFLOP/s, more than the peak of 0.002" in said[0], said
    assert "other work held the cores" in said[0] and "set train.peak_tflops" in said[0]
