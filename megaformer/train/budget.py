"""A run bounded by time: the updates it will reach, the warm-up they call for, whether to compile, and
whether a resumed run has anything left (:func:`nothing_left_to_train`).

``train.max_minutes`` bounds a run by training time, but the paper's schedule counts
updates: a warm-up of 400 updates is a tenth of a run that reaches 4,000 and all of one
that reaches 400 (a slow CPU's 15 minutes). With ``train.warmup_fraction`` > 0 the
warm-up lasts that share of the updates the run is expected to reach, at most
``train.warmup_steps``, and peaks at the same lr (:func:`megaformer.train.schedule.fitted_lr`).

The expectation is the measured step rate: the training seconds the ranks have spent
(their mean, so every rank holds the same figure) over the steps since the run settled
(``SETTLE_STEPS`` after its start or resume: the first steps compile layers and fill
caches). It is measured again every ``REFIT_EVERY`` steps while the run still warms up, so
a rate that drifts moves the end of the warm-up; once the warm-up has ended it stays.
The lr cool-down (``train.cooldown_fraction``) begins when its share of the time is left and
lasts the steps that time is expected to give at the rate of the later half of the settled
steps (:meth:`BudgetPlan.steps_left`, :func:`megaformer.train.schedule.cooldown_start`).

``train.compile=auto`` compiles the layers where the gain has been measured to repay the
compile time within the run (:func:`compile_choice`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megaformer.config import TrainConfig

SETTLE_STEPS = 5  # steps after a start or resume left out of the rate (compiling, allocator, caches)
RATE_STEPS = 10  # steps of settled rate before the first estimate
REFIT_EVERY = 10  # steps between estimates during the warm-up


@dataclass
class BudgetPlan:
    """The warm-up of a time-bounded run, fitted to the steps it is expected to reach."""

    max_minutes: float
    max_steps: int
    warmup_fraction: float
    warmup_steps: int
    _from: tuple[int, float] | None = None  # (step, seconds) where the settled rate is measured from
    _first_step: int | None = None
    _marks: list[tuple[int, float]] = field(default_factory=list)  # (step, seconds) every REFIT_EVERY settled steps

    @property
    def active(self) -> bool:
        return self.warmup_fraction > 0 and self.max_minutes > 0

    def observe(self, step: int, seconds: float) -> None:
        """Note a step done: ``step`` steps, ``seconds`` of training (the world's mean). The first is the (re)start."""
        if self._first_step is None:
            self._first_step = step
        if self._from is None and step >= self._first_step + SETTLE_STEPS:
            self._from = (step, seconds)
        if self._from is not None and (step - self._from[0]) % REFIT_EVERY == 0:
            self._marks.append((step, seconds))

    def expected_steps(self, step: int, seconds: float) -> int | None:
        """The steps the run will have reached when its time is spent, or None while it is too early to say."""
        if self._from is None:
            return None
        done, spent = step - self._from[0], seconds - self._from[1]
        if done < RATE_STEPS or spent <= 0:
            return None
        left = max(60 * self.max_minutes - seconds, 0.0)
        return min(step + int(left * done / spent), self.max_steps)

    def steps_left(self, step: int, seconds: float) -> int | None:
        """The steps the rest of the time is expected to give at the recent rate, or None while it is too early.

        The rate is that of the later half of the settled steps: the first steps after a start (compiling
        with an empty cache can take minutes there) and an earlier load of the machine are left out.
        """
        if self._from is None:
            return None
        anchor = next((m for m in self._marks if 2 * m[0] >= self._from[0] + step), self._from)
        done, spent = step - anchor[0], seconds - anchor[1]
        if done < RATE_STEPS or spent <= 0:
            return None
        return int(max(60 * self.max_minutes - seconds, 0.0) * done / spent)

    def fit(self, step: int, updates: int, seconds: float, current: int | None) -> int | None:
        """The warm-up (in updates) to use from now on, or None to keep ``current`` (None: warmup_steps).

        Call it after every step. It fits only while the warm-up has not ended (``updates``
        below it), every ``REFIT_EVERY`` steps; the result is above ``updates`` (the lr
        never jumps past the peak) and at most ``train.warmup_steps``.
        """
        self.observe(step, seconds)
        warming = current if current is not None else self.warmup_steps
        if not self.active or updates >= warming or step % REFIT_EVERY:
            return None
        expected = self.expected_steps(step, seconds)
        if expected is None:
            return None
        fitted = min(max(round(self.warmup_fraction * expected), 1, updates + 1), self.warmup_steps)
        return None if fitted == warming else fitted


# Measured with benchmarks/throughput.py --compile and in training runs (docs/results.md):
# on 2 AMD EPYC cores with AVX512-BF16, bf16: compiled layers +5 % target tokens/s, ~30 s of compiling;
# on 2 Intel Xeon cores with AMX, bf16: +4 %, and from a fresh clone (an empty compile cache, as a new user's
# first run has) the first 50 steps took 1 min 45 s - 2 min 9 s against ~40 s eager; with the cache warm, ~20 s.
# on 2 cores with AVX2 only, fp32: compiling took 3.5 minutes and the compiled layers were no faster.
CPU_COMPILE_MINUTES = 1.5  # compile time on a CPU with native bf16, cache empty (the slower machine's)
CPU_BF16_GAIN = 0.05


def nothing_left_to_train(t: TrainConfig, step: int, cooled_at: int | None, seconds: float) -> str | None:
    """Why a (resumed) run at ``step`` has nothing left to train, with the option to change; None if it has.

    ``cooled_at``: the update at which the run's lr cool-down ended, if it has; ``seconds``: its training time.
    """
    if step >= t.max_steps:
        return f"the checkpoint is at step {step}, train.max_steps={t.max_steps}: raise train.max_steps to go on"
    if cooled_at is not None:
        return (
            f"the lr cool-down of this run ended at update {cooled_at} (the lr is 0 from there): "
            f"resume with --set train.cooldown_fraction=0 to drop it and train on at the plain schedule"
        )
    if t.max_minutes > 0 and seconds >= 60 * t.max_minutes:
        return (
            f"train.max_minutes={t.max_minutes} is spent ({seconds / 60:.1f} minutes trained): "
            f"raise train.max_minutes to go on"
        )
    return None


def compile_choice(setting: str, device: torch.device, precision: str, max_minutes: float, native_bf16: bool):
    """(compile the layers?, why) for ``train.compile`` = true | false | auto on ``device``.

    auto compiles on a CUDA device (fused element-wise kernels, ~1.1x on a GPU), and on a
    CPU only in bf16 with native bf16 kernels when the measured gain (``CPU_BF16_GAIN``)
    repays the compile time within ``max_minutes`` (0 = unbounded: it does). fp32 on a CPU
    runs eager: there the compiled layers were measured no faster, after minutes of compiling.
    """
    if setting in ("true", "false"):
        return setting == "true", f"train.compile={setting}"
    if device.type == "cuda":
        return True, "train.compile=auto: compiled on a GPU (fused element-wise kernels)"
    if precision != "bf16" or not native_bf16:
        return False, (
            f"train.compile=auto: eager ({precision} on a CPU{'' if native_bf16 else ' without native bf16'}: "
            f"compiled layers were measured no faster there, after minutes of compiling)"
        )
    repaid = max_minutes <= 0 or CPU_BF16_GAIN * (max_minutes - CPU_COMPILE_MINUTES) > CPU_COMPILE_MINUTES
    if repaid:
        return True, (
            f"train.compile=auto: compiled (bf16 on this CPU: +{CPU_BF16_GAIN:.0%} tokens/s for "
            f"~{CPU_COMPILE_MINUTES:g} min of compiling, repaid within train.max_minutes={max_minutes:g})"
        )
    return False, (
        f"train.compile=auto: eager (+{CPU_BF16_GAIN:.0%} tokens/s would not repay ~{CPU_COMPILE_MINUTES:g} min "
        f"of compiling within train.max_minutes={max_minutes:g})"
    )
