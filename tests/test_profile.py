"""The profiled window's summary: the GPU's busy share is the union of its kernels over the steps' span."""

from __future__ import annotations

from types import SimpleNamespace

from torch.autograd import DeviceType

from megaformer.train.profile import STEP_RANGE, summarize


def event(
    name: str, start: float, end: float, device: DeviceType = DeviceType.CUDA, self_us: float = 0.0, range_=False
):
    """One of ``prof.events()``; ``range_``: a record_function range (on the GPU's timeline, a user annotation)."""
    return SimpleNamespace(
        name=name,
        time_range=SimpleNamespace(start=start, end=end),
        device_type=device,
        self_cpu_time_total=self_us,
        is_user_annotation=range_,
    )


def test_busy_share_counts_overlapping_kernels_once_and_ranks_kernels_by_time():
    events = [
        event(STEP_RANGE, 0, 400, DeviceType.CPU),
        event(STEP_RANGE, 400, 800, DeviceType.CPU),
        event("gemm", 100, 300),
        event("gemm", 250, 350),  # overlaps the first: 100..350 busy
        event("softmax", 500, 600),
        event("gemm", 700, 1000),  # ends after the last step's host side: the window ends at 1000
    ]
    s = summarize(events, steps=2)
    assert s.busy == (250 + 100 + 300) / 1000
    assert s.wall_ms == 1000 / 1000 / 2
    assert [name for name, _ in s.top] == ["gemm", "softmax"]
    assert s.top[0][1] == (200 + 100 + 300) / 1000 / 2
    assert "GPU busy 65.0 %" in s.describe("cuda:0")


def test_on_a_cpu_the_top_operators_by_self_time_and_no_busy_share():
    events = [
        event(STEP_RANGE, 0, 100, DeviceType.CPU),
        event("aten::mm", 10, 50, DeviceType.CPU, self_us=40),
        event("aten::add", 50, 60, DeviceType.CPU, self_us=10),
        event("aten::mm", 60, 90, DeviceType.CPU, self_us=30),
    ]
    s = summarize(events, steps=1)
    assert s.busy is None and s.top == [("aten::mm", 0.07), ("aten::add", 0.01)]
    assert "operators (self CPU time)" in s.describe("cpu")


def test_ranges_on_the_gpus_timeline_are_not_kernels():
    """With CUDA profiling every record_function range (the step's, the optimizer's, a compiled region's) is also
    an event on the GPU's timeline, spanning its kernels and the gaps between them: counted as kernels they filled
    the top ten with whole layers and covered the idle gaps in the busy share."""
    events = [
        event(STEP_RANGE, 0, 1000, DeviceType.CPU, range_=True),
        event(STEP_RANGE, 90, 1000, range_=True),
        event("Torch-Compiled Region", 100, 900, range_=True),
        event("Optimizer.step#AdamW.step", 800, 900, range_=True),
        event("gemm", 100, 300),
        event("gemm", 700, 800),
        event("multi_tensor_apply_kernel", 850, 900),
    ]
    s = summarize(events, steps=1)
    assert s.busy == (200 + 100 + 50) / 1000
    assert [name for name, _ in s.top] == ["gemm", "multi_tensor_apply_kernel"]
