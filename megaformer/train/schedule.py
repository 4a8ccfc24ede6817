"""The learning-rate schedule of the paper (section 5.3), with an optional cool-down.

    lrate = lr_scale * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)

Linear warm-up for ``warmup_steps`` optimizer steps, then decay with the inverse square
root of the step. ``step`` counts optimizer updates from 1.

A run bounded by time (``train.warmup_fraction`` > 0 with ``train.max_minutes``) may warm up
over fewer updates, ``W`` (see :mod:`megaformer.train.budget`), to the same peak: the lr is
``peak x min(step / W, sqrt(W / step))`` with ``peak`` the configured schedule's lr at
``warmup_steps``. With ``W = warmup_steps`` that is the paper's formula exactly.

``train.cooldown_fraction`` > 0 multiplies the last part of a run by a linear ramp to 0
(the "decay" of a warmup-stable-decay schedule): from update ``start + 1`` to
``start + length`` the factor falls from ``length / (length + 1)`` to ``1 / (length + 1)``,
so every update of the cool-down still moves the weights. :func:`cooldown_start` says when
it begins and how long it lasts, for a budget in steps or in minutes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def inverse_sqrt_lr(step: int, d_model: int, warmup_steps: int, lr_scale: float = 1.0) -> float:
    step = max(step, 1)
    return lr_scale * d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)


@dataclass(frozen=True)
class Cooldown:
    """The lr ramps linearly to 0 over updates ``start + 1`` .. ``start + length``."""

    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length

    def factor(self, step: int) -> float:
        """The multiplier of update ``step`` (from 1): 1 before the cool-down, 0 after it."""
        if step <= self.start:
            return 1.0
        return max(self.end - step + 1, 0) / (self.length + 1)


def cooldown_time_reached(fraction: float, train_seconds: float, max_minutes: float) -> bool:
    """Whether ``1 - fraction`` of a ``max_minutes`` budget (0 = none) is spent: each rank asks its own clock."""
    return fraction > 0 and max_minutes > 0 and train_seconds >= (1 - fraction) * 60 * max_minutes


def cooldown_start(
    fraction: float, updates: int, max_steps: int, time_reached: bool, expected_left: int | None = None
) -> Cooldown | None:
    """The cool-down to begin after update ``updates``, or None while the run is not that far yet.

    It begins once ``1 - fraction`` of either budget is spent: of ``max_steps`` (it then
    lasts to ``max_steps``) or of the training time (``time_reached``, agreed by the
    ranks; it then lasts as many updates as the rest of the time is expected to give:
    ``expected_left``, measured at the recent rate, or else at the run's mean rate so far,
    ``updates x fraction / (1 - fraction)``, which a slow start such as compiling lowers;
    never past ``max_steps``).
    """
    if fraction <= 0:
        return None
    left = max(max_steps - updates, 1)
    if updates >= max_steps - math.ceil(fraction * max_steps):
        return Cooldown(updates, left)
    if time_reached:
        length = expected_left if expected_left is not None else round(updates * fraction / (1 - fraction))
        return Cooldown(updates, min(max(length, 1), left))
    return None


def fitted_lr(step: int, d_model: int, warmup_steps: int, lr_scale: float, warmup: int) -> float:
    """The lr of update ``step`` warming up over ``warmup`` updates to the peak of ``warmup_steps``."""
    step = max(step, 1)
    peak = inverse_sqrt_lr(warmup_steps, d_model, warmup_steps, lr_scale)
    return peak * min(step / warmup, math.sqrt(warmup / step))


class InverseSqrtSchedule:
    """A ``LambdaLR`` multiplier (the optimizer's base lr is 1.0): index 0 is the first update.

    ``warmup``: the updates the warm-up lasts when a time budget shortened it (None: the
    configured ``warmup_steps``).
    """

    def __init__(self, d_model: int, warmup_steps: int, lr_scale: float = 1.0) -> None:
        self.d_model, self.warmup_steps, self.lr_scale = d_model, warmup_steps, lr_scale
        self.cooldown: Cooldown | None = None
        self.warmup: int | None = None

    def __call__(self, index: int) -> float:
        if self.warmup is None:
            lr = inverse_sqrt_lr(index + 1, self.d_model, self.warmup_steps, self.lr_scale)
        else:
            lr = fitted_lr(index + 1, self.d_model, self.warmup_steps, self.lr_scale, self.warmup)
        return lr * self.cooldown.factor(index + 1) if self.cooldown else lr
