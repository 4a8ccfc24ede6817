"""A run bounded by time fits its warm-up to the steps it will reach, and compiles only where it pays.

Unit checks of :mod:`megaformer.train.budget` and the fitted schedule against the paper's
formula, then a tiny two-process run with a time budget: the warm-up it logs is the
configured share of the steps it reached, its lr follows the fitted schedule, and a resume
after the warm-up keeps the fitted one. The choices of ``make multi30k`` are tested in
tests/test_multi30k_recipe.py.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from train_helpers import common, losses, ok, train

from megaformer.config import load_config
from megaformer.errors import ConfigError
from megaformer.train.budget import RATE_STEPS, REFIT_EVERY, SETTLE_STEPS, BudgetPlan, compile_choice
from megaformer.train.schedule import Cooldown, InverseSqrtSchedule, cooldown_start, fitted_lr, inverse_sqrt_lr

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_fitted_schedule_at_the_configured_warmup_is_the_papers():
    for step in (1, 7, 399, 400, 401, 5000):
        assert fitted_lr(step, 512, 400, 0.7, 400) == pytest.approx(inverse_sqrt_lr(step, 512, 400, 0.7), rel=1e-12)


def test_a_shorter_warmup_reaches_the_same_peak_sooner_then_decays_as_the_inverse_square_root():
    peak = inverse_sqrt_lr(400, 256, 400, 0.5)
    assert fitted_lr(50, 256, 400, 0.5, 50) == pytest.approx(peak, rel=1e-12)
    assert fitted_lr(25, 256, 400, 0.5, 50) == pytest.approx(peak / 2, rel=1e-12)
    assert fitted_lr(200, 256, 400, 0.5, 50) == pytest.approx(peak / 2, rel=1e-12)  # sqrt(50 / 200)
    schedule = InverseSqrtSchedule(256, 400, 0.5)
    assert schedule(49) == pytest.approx(inverse_sqrt_lr(50, 256, 400, 0.5))
    schedule.warmup = 50
    assert schedule(49) == pytest.approx(peak, rel=1e-12)


def _fits(plan: BudgetPlan, seconds_per_step: float, steps: int, start: int = 0) -> dict[int, int]:
    """Run ``plan`` over ``steps`` steps of a steady rate; the warm-ups it fitted, by step."""
    warmup, fitted = None, {}
    for step in range(start + 1, start + steps + 1):
        seconds = (step - start - 1) * seconds_per_step + 30.0 * (step > start + 1)  # a slow first step
        new = plan.fit(step, step, seconds, warmup)
        if new is not None:
            warmup = fitted[step] = new
    return fitted


def test_the_warmup_is_the_share_of_the_steps_the_time_allows_at_the_settled_rate():
    # 15 minutes at 1.5 s a step (after a first step of 30 s, left out of the rate): ~600 steps
    plan = BudgetPlan(max_minutes=15, max_steps=100_000, warmup_fraction=0.2, warmup_steps=400)
    fitted = _fits(plan, 1.5, 200)
    first = min(fitted)
    assert first == ((SETTLE_STEPS + RATE_STEPS) // REFIT_EVERY + 1) * REFIT_EVERY
    assert all(step % REFIT_EVERY == 0 for step in fitted)
    final = fitted[max(fitted)]
    assert final == pytest.approx(0.2 * (15 * 60 - 30) / 1.5, rel=0.03)
    assert max(fitted) < final  # no refit once the warm-up has ended


def test_the_warmup_never_exceeds_the_configured_one_nor_falls_below_the_updates_done():
    plan = BudgetPlan(max_minutes=600, max_steps=100_000, warmup_fraction=0.2, warmup_steps=400)
    assert _fits(plan, 0.5, 100) == {}  # 0.2 x 72,000 steps: the configured 400 stands
    plan = BudgetPlan(max_minutes=0.5, max_steps=100_000, warmup_fraction=0.2, warmup_steps=400)
    fitted = _fits(plan, 0.1, 60)
    assert all(w > step for step, w in fitted.items())  # above the updates done when it was fitted
    capped = BudgetPlan(max_minutes=15, max_steps=300, warmup_fraction=0.5, warmup_steps=400)
    assert max(_fits(capped, 0.1, 40).values()) == 150  # half of train.max_steps, which comes first


def test_the_cooldown_lasts_the_steps_the_rest_of_the_time_gives_at_the_recent_rate():
    """A slow start (compiling: 90 s over steps 6-50) does not shorten the ramp, as the mean rate would."""
    plan = BudgetPlan(max_minutes=15, max_steps=100_000, warmup_fraction=0.2, warmup_steps=400)
    seconds, step = 0.0, 0
    while seconds < 0.7 * 15 * 60:  # the cool-down's 30 % of the time is left
        step += 1
        seconds += 0.6 + (2.0 if step <= 50 else 0.0)
        plan.fit(step, step, seconds, None)
    left = plan.steps_left(step, seconds)
    assert left == pytest.approx((15 * 60 - seconds) / 0.6, rel=0.01), (left, step)
    mean_rate = round(step * 0.3 / 0.7)  # the fallback: about a sixth fewer updates than the time gives
    assert cooldown_start(0.3, step, 100_000, True, left) == Cooldown(step, left) and mean_rate < 0.9 * left
    assert cooldown_start(0.3, step, 100_000, True) == Cooldown(step, mean_rate)
    assert BudgetPlan(15, 100_000, 0.2, 400).steps_left(5, 3.0) is None  # too early to say


def test_without_a_time_budget_or_a_fraction_nothing_is_fitted():
    assert _fits(BudgetPlan(0, 100_000, 0.2, 400), 1.0, 100) == {}
    assert _fits(BudgetPlan(15, 100_000, 0.0, 400), 1.0, 100) == {}


def test_a_resumed_run_measures_its_rate_from_the_resume():
    plan = BudgetPlan(max_minutes=15, max_steps=100_000, warmup_fraction=0.2, warmup_steps=400)
    fitted = _fits(plan, 1.5, 100, start=40)
    assert min(fitted) >= 40 + SETTLE_STEPS + RATE_STEPS


def test_compile_auto_follows_the_device_precision_and_budget():
    assert compile_choice("true", CPU, "fp32", 15, False)[0] is True
    assert compile_choice("false", CUDA, "bf16", 0, True)[0] is False
    assert compile_choice("auto", CUDA, "bf16", 5, True)[0] is True
    chosen, why = compile_choice("auto", CPU, "fp32", 60, False)
    assert not chosen and "eager" in why and "without native bf16" in why
    assert compile_choice("auto", CPU, "bf16", 60, True)[0] is True
    assert compile_choice("auto", CPU, "bf16", 0, True)[0] is True  # unbounded: repaid
    for minutes in (5, 15):  # +5 % of the steps does not repay ~1.5 min of compiling with an empty cache
        chosen, why = compile_choice("auto", CPU, "bf16", minutes, True)
        assert not chosen and "would not repay" in why, minutes


@pytest.mark.parametrize("value", ["maybe", "2"])
def test_compile_and_warmup_fraction_settings_are_checked(value):
    with pytest.raises(ConfigError, match="train.compile"):
        load_config(None, [f"train.compile={value}"])
    with pytest.raises(ConfigError, match="train.warmup_fraction"):
        load_config(None, ["train.warmup_fraction=1.5"])
    assert load_config(None, ["train.compile=true"]).train.compile == "true"  # YAML's boolean


def test_a_time_bounded_run_warms_up_over_its_share_and_a_resume_keeps_it(corpus, tmp_path):
    """tiny, 2 ranks, 0.1875 minutes, warmup_fraction 0.25 of a configured 100 000: fitted, logged, followed, saved.

    Each step lasts exactly 125 ms by the trainer's clock (the ``step_clock`` fault; exact in binary, so are the
    sums): measured, a test worker sharing the 2 cores could halve the rate after the fit, or settle it late.
    """
    run = tmp_path / "run"
    sets = [*common(corpus), "train.max_steps=100000", "train.warmup_fraction=0.25", "train.warmup_steps=100000"]
    sets += ["train.save_interval=0"]
    clock = "step_clock:step=125"
    proc = train(run, 2, [*sets, "train.max_minutes=0.1875"], fault=clock)
    ok(proc)
    fits = re.findall(
        r"~([\d,]+) steps expected in train.max_minutes=0.1875; the warm-up ends at update ([\d,]+)", proc.stdout
    )
    # The first fit, at step 20: 14 steps since the run settled (step 6) in 1.75 s (the world's seconds lag a
    # step), and 8.875 s of the 11.25 left: 71 more, 91 expected; a quarter, 22.75, rounds to 23. A steady rate
    # moves no later fit by 10 %, so none is logged.
    assert [tuple(int(n.replace(",", "")) for n in fit) for fit in fits] == [(91, 23)], proc.stdout[-3000:]
    curve = losses(run)
    last = max(curve)
    assert last == 91  # 90 steps spend the 11.25 s; the 91st sees it (its flags are set before it runs) and ends
    (meta,) = (run / "checkpoints").glob("step-*/meta.json")
    warmup = json.loads(meta.read_text())["run"]["engine"]["warmup"]
    assert warmup == 23 and re.findall(r"the warm-up ended at update ([\d,]+)", proc.stdout) == ["23"], proc.stdout
    for step in range(warmup, last + 1):  # after the last fit the lr is the fitted schedule's (the next update's)
        assert curve[step]["lr"] == pytest.approx(fitted_lr(step + 1, 64, 100000, 2.0, warmup), rel=1e-9), step
    more = train(run, 2, [*sets, "train.max_minutes=0.25"], fault=clock)
    ok(more)
    assert "the warm-up end" not in more.stdout  # the saved warm-up has ended: it stays
    resumed = losses(run)
    assert max(resumed) == 121  # 15 s: spent by step 120, seen by 121
    for step in range(last + 1, max(resumed) + 1):
        assert resumed[step]["lr"] == pytest.approx(fitted_lr(step + 1, 64, 100000, 2.0, warmup), rel=1e-9), step
