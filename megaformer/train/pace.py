"""The run's length as it goes: the warm-up fitted to a time budget, the cool-down begun, and what is left.

:class:`Pace` acts on the engine's lr schedule (its ``warmup`` and ``cooldown``, which the
engine's state keeps) from figures that are the same on every rank: the step and update
counts, and the world's mean training seconds carried by the step's all-reduce. Every rank
therefore fits the same warm-up and begins the same cool-down at the same update.
"""

from __future__ import annotations

from collections.abc import Callable

from megaformer.config import TrainConfig
from megaformer.train.budget import BudgetPlan, nothing_left_to_train
from megaformer.train.engine_state import EngineState
from megaformer.train.schedule import cooldown_start


class Pace:
    """The time budget's warm-up (``train.warmup_fraction``) and the cool-down (``train.cooldown_fraction``)."""

    def __init__(self, engine: EngineState, t: TrainConfig, log: Callable[[str], None]) -> None:
        self.engine, self.t, self.log = engine, t, log
        self.budget = BudgetPlan(t.max_minutes, t.max_steps, t.warmup_fraction, t.warmup_steps)
        self._warmup_said: int | None = None  # the fitted warm-up last logged; None again once its end is

    def cooled(self) -> bool:
        """The cool-down has ended (the run ends with it)."""
        cooldown = self.engine.cooldown
        return cooldown is not None and self.engine.optimizer_steps >= cooldown.end

    def nothing_left(self, train_seconds: float) -> str | None:
        """Why a (resumed) run has no step left to train; the same on every rank (the run's state)."""
        cooled_at = self.engine.cooldown.end if self.cooled() else None
        return nothing_left_to_train(self.t, self.engine.global_steps, cooled_at, train_seconds)

    def cool_down(self, time_reached: bool, world_seconds: float) -> bool:
        """Begin the cool-down when it is due; True when it has ended (the run ends with it).

        ``time_reached`` is the world's, and the update count is the same on every rank:
        every rank begins it at the same update, with the same length.
        """
        t, engine, updates = self.t, self.engine, self.engine.optimizer_steps
        if engine.cooldown is None:
            expected_left = self.budget.steps_left(engine.global_steps, world_seconds) if time_reached else None
            cooldown = cooldown_start(t.cooldown_fraction, updates, t.max_steps, time_reached, expected_left)
            if cooldown is None:
                return False
            engine.set_cooldown(cooldown)
            self.log(
                f"train: train.cooldown_fraction={t.cooldown_fraction}: after update {updates}, the lr ramps down "
                f"to 0 over the next {cooldown.length} updates (from {engine.lr():.3g})"
            )
        return self.cooled()

    def fit_warmup(self, world_seconds: float) -> None:
        """Fit the warm-up to the steps the time budget is expected to reach (train.warmup_fraction)."""
        engine = self.engine
        step, updates = engine.global_steps, engine.optimizer_steps
        fitted = self.budget.fit(step, updates, world_seconds, engine.warmup)
        if fitted is None:
            if self._warmup_said is not None and updates == engine.warmup:  # refits move it by < 10 % unsaid
                self._warmup_said = None
                self.log(
                    f"train: the warm-up ended at update {updates:,} (train.warmup_fraction), lr {engine.lr():.3g}"
                )
            return
        said = self._warmup_said
        engine.set_warmup(fitted)
        if said is None or abs(fitted - said) > 0.1 * said:
            self._warmup_said = fitted
            t = self.t
            expected = self.budget.expected_steps(step, world_seconds)
            bound = (
                f"train.max_steps={t.max_steps:,}"
                if expected == t.max_steps
                else f"train.max_minutes={t.max_minutes:g}"
            )
            self.log(
                f"train: train.warmup_fraction={t.warmup_fraction:g}: ~{expected:,} steps expected in {bound}; "
                f"the warm-up ends at update {fitted:,}"
            )
