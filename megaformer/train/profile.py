"""A torch.profiler window over a few training steps: where the time of a steady step goes.

``train.profile_from=N`` (0 = off) profiles steps N .. N + ``train.profile_steps`` - 1 of
every rank, each step inside a ``megaformer.step`` range. When the window closes, each
rank writes ``RUN_DIR/profile/trace-rank{R}.json`` (Chrome trace; open it in Perfetto) and
``summary-rank{R}.json``, and rank 0 logs one line: the steps' wall time, on a GPU the
share of it the GPU was busy (the union of its kernels' intervals over the window, from
the first profiled step's start to the later of the last step's end and its last
kernel's), and the ten kernels (on a CPU: operators) with the most time.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

STEP_RANGE = "megaformer.step"


@dataclass(frozen=True)
class Summary:
    """One rank's profiled window."""

    steps: int
    wall_ms: float  # the window, per step
    busy: float | None  # GPU busy share of the window (None on a CPU)
    top: list[tuple[str, float]]  # (kernel or operator, ms per step), most time first

    def describe(self, device: str) -> str:
        busy = f", GPU busy {100 * self.busy:.1f} %" if self.busy is not None else ""
        what = "kernels" if self.busy is not None else "operators (self CPU time)"
        top = "; ".join(f"{name[:60]} {ms:.2f} ms" for name, ms in self.top)
        return f"{self.steps} steps on {device}: {self.wall_ms:.1f} ms a step{busy}; top {what} a step: {top}"


def _union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _is_annotation(event) -> bool:
    """A ``record_function`` range (ours, the optimizer's, a compiled region's): the profiler shows it on the GPU's
    timeline too, spanning the kernels inside it and the gaps between them; it is not a kernel."""
    return event.name == STEP_RANGE or bool(getattr(event, "is_user_annotation", False))


def _is_step(event) -> bool:
    """The host side of one profiled step (its GPU-side twin spans only the step's kernels)."""
    return event.name == STEP_RANGE and event.device_type == DeviceType.CPU


def summarize(events: list, steps: int, top: int = 10) -> Summary:
    """The window's summary from the profiler's events (``prof.events()``), ``steps`` steps of ``STEP_RANGE``."""
    ranges = [(e.time_range.start, e.time_range.end) for e in events if _is_step(e)]
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not _is_annotation(e)]
    if not ranges:
        return Summary(steps, 0.0, None, [])
    start, end = min(a for a, _ in ranges), max(b for _, b in ranges)
    totals: dict[str, float] = {}
    if kernels:
        spans = [(max(k.time_range.start, start), k.time_range.end) for k in kernels if k.time_range.end > start]
        end = max([end] + [b for _, b in spans])
        busy: float | None = _union(spans) / max(end - start, 1e-9)
        for k in kernels:
            totals[k.name] = totals.get(k.name, 0.0) + (k.time_range.end - k.time_range.start)
    else:
        busy = None
        for e in events:
            if e.device_type == DeviceType.CPU and e.name != STEP_RANGE:
                totals[e.name] = totals.get(e.name, 0.0) + e.self_cpu_time_total
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return Summary(steps, (end - start) / 1000 / steps, busy, [(n, us / 1000 / steps) for n, us in ranked])


class StepProfiler:
    """Profiles steps ``first .. first + count - 1``; :meth:`step` wraps each training step."""

    def __init__(self, first: int, count: int, out: Path, rank: int, device: torch.device, log: Callable) -> None:
        self.first, self.count, self.out, self.rank, self.device, self.log = first, count, out, rank, device, log
        self._prof: profile | None = None
        self.summary: Summary | None = None

    def step(self, number: int) -> AbstractContextManager:
        """The context of training step ``number``: opens the window at its first step, closes it after its last."""
        if not self.first or not self.first <= number < self.first + self.count:
            return nullcontext()
        if number == self.first:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._prof = profile(activities=activities, record_shapes=False)
            self._prof.__enter__()
        return _Step(self, number == self.first + self.count - 1)

    def _close(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._prof.__exit__(None, None, None)
        self.out.mkdir(parents=True, exist_ok=True)
        self._prof.export_chrome_trace(str(self.out / f"trace-rank{self.rank}.json"))
        self.summary = summarize(list(self._prof.events()), self.count)
        summary = {**self.summary.__dict__, "first_step": self.first, "device": str(self.device)}
        (self.out / f"summary-rank{self.rank}.json").write_text(json.dumps(summary, indent=1) + "\n")
        self.log(
            f"profile: steps {self.first}-{self.first + self.count - 1}, "
            f"{self.summary.describe(str(self.device))} ({self.out})"
        )
        self._prof = None


class _Step:
    def __init__(self, profiler: StepProfiler, last: bool) -> None:
        self.profiler, self.last = profiler, last
        self._range = record_function(STEP_RANGE)

    def __enter__(self) -> None:
        self._range.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._range.__exit__(*exc)
        if self.last and exc[0] is None:
            self.profiler._close()
