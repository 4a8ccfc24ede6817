"""The learning-rate schedule of the paper (section 5.3).

    lrate = lr_scale * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)

Linear warm-up for ``warmup_steps`` optimizer steps, then decay with the inverse square
root of the step. ``step`` counts optimizer updates from 1.
"""

from __future__ import annotations


def inverse_sqrt_lr(step: int, d_model: int, warmup_steps: int, lr_scale: float = 1.0) -> float:
    step = max(step, 1)
    return lr_scale * d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)


class InverseSqrtSchedule:
    """A ``LambdaLR`` multiplier (the optimizer's base lr is 1.0): index 0 is the first update."""

    def __init__(self, d_model: int, warmup_steps: int, lr_scale: float = 1.0) -> None:
        self.d_model, self.warmup_steps, self.lr_scale = d_model, warmup_steps, lr_scale

    def __call__(self, index: int) -> float:
        return inverse_sqrt_lr(index + 1, self.d_model, self.warmup_steps, self.lr_scale)
