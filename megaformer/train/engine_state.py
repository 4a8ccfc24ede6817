"""The engines' state: weights, Adam moments and step counts at this rank's TP shape, the lr schedule, the counters.

Shared by the DeepSpeed engine (:mod:`megaformer.train.engine`, the only code touching
DeepSpeed's internals) and the lean one (:mod:`megaformer.train.lean`), so that either
resumes the other's checkpoints: :class:`EngineState` holds what both do alike (the lr
schedule with its cool-down and fitted warm-up, the finite check, the counters), and both
take Adam's settings and the lr schedule from here. For the DeepSpeed engine,
``export_tensors`` gathers fp32 weights and Adam moments complete over DP (ZeRO
partitions included), ``import_tensors`` puts them back, and the optimizer's step count
is read and set where each optimizer keeps it (torch's fused Adam: a tensor on the
parameter's device; apex's and DeepSpeed's FusedAdam: a number in each param group).
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING

import torch

from megaformer.config import Config, TrainConfig
from megaformer.train.schedule import Cooldown, InverseSqrtSchedule

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def adam_settings(t: TrainConfig) -> dict:
    """Adam's arguments from the config (the lr is the schedule's multiplier of 1)."""
    return dict(lr=1.0, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay)


def lr_schedule(cfg: Config, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """The paper's schedule (:class:`InverseSqrtSchedule`) over ``optimizer``'s updates."""
    schedule = InverseSqrtSchedule(cfg.model.d_model, cfg.train.warmup_steps, cfg.train.lr_scale)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def cooldown_of(saved: list | None) -> Cooldown | None:
    """The cool-down a state holds as ``[start, length]`` (None: none); ValueError for one that cannot be."""
    if saved is None:
        return None
    start, length = (int(n) for n in saved)
    if start < 0 or length < 1:
        raise ValueError(f"cooldown {saved}: needs a start >= 0 and a length >= 1")
    return Cooldown(start, length)


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in fp32 on the CPU, never sharing the live tensor's memory (a CPU tensor is copied too)."""
    return tensor.detach().to("cpu", torch.float32, copy=True)


class EngineState:
    """What both engines do alike; each has ``lr_scheduler``, ``optimizer_steps`` and ``grad_norm_on_device()``."""

    lr_scheduler: torch.optim.lr_scheduler.LambdaLR

    @property
    def cooldown(self) -> Cooldown | None:
        return self._schedule().cooldown

    def set_cooldown(self, cooldown: Cooldown | None) -> None:
        """Ramp the lr down as ``cooldown`` says, from the next update on (the current lr is recomputed)."""
        self._schedule().cooldown = cooldown
        rewind_schedule(self.lr_scheduler, self.optimizer_steps)

    @property
    def warmup(self) -> int | None:
        return self._schedule().warmup

    def set_warmup(self, updates: int | None) -> None:
        """Warm up over ``updates`` updates (None: train.warmup_steps), from the next update on."""
        self._schedule().warmup = updates
        rewind_schedule(self.lr_scheduler, self.optimizer_steps)

    def _schedule(self) -> InverseSqrtSchedule:
        return self.lr_scheduler.lr_lambdas[0]  # one multiplier, shared by every param group

    def grad_norm(self) -> float | None:
        """The global gradient norm of the last step; None if unknown. A read of the device: for the log;
        :meth:`grad_norm_on_device` does not wait."""
        norm = self.grad_norm_on_device()
        return float(norm) if norm is not None else None

    def not_finite(self, loss: torch.Tensor) -> torch.Tensor:
        """Whether ``loss`` or the step's gradient norm is inf or NaN, as a boolean on the device (not read)."""
        bad = ~torch.isfinite(loss)
        norm = self.grad_norm_on_device()
        if torch.is_tensor(norm):
            return bad | ~torch.isfinite(norm.to(bad.device)).all()
        return bad | (norm is not None and not math.isfinite(norm))

    def schedule_counters(self) -> dict:
        """The schedule's state for ``counters``: the cool-down's ``[start, length]``, the fitted warm-up (or None)."""
        return {
            "cooldown": None if self.cooldown is None else [self.cooldown.start, self.cooldown.length],
            "warmup": self.warmup,
        }

    def load_schedule(self, counters: dict) -> None:
        """The schedule of :meth:`schedule_counters`, the lr set to the update count's (call after the counters)."""
        warmup = counters.get("warmup")  # absent before time budgets fitted the warm-up
        if warmup is not None and (isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1):
            raise ValueError(f"warmup {warmup!r}: needs an integer >= 1 or null")
        self._schedule().warmup = warmup
        self.set_cooldown(cooldown_of(counters.get("cooldown")))  # also sets the lr to the step count's


def inner_optimizer(ds: DeepSpeedEngine) -> torch.optim.Optimizer:
    """The optimizer that holds Adam's state (inside DeepSpeed's ZeRO wrapper, if any)."""
    opt = ds.optimizer
    return getattr(opt, "optimizer", opt)


def uses_zero(ds: DeepSpeedEngine) -> bool:
    return ds.zero_optimization_stage() > 0


def _steps_in_groups(opt: torch.optim.Optimizer) -> bool:
    """apex's and DeepSpeed's FusedAdam count steps in ``param_groups``; torch's Adam per parameter."""
    return any("step" in g for g in opt.param_groups) or (
        not isinstance(opt, torch.optim.Adam | torch.optim.AdamW) and type(opt).__name__ == "FusedAdam"
    )


def optimizer_step_count(opt: torch.optim.Optimizer) -> int:
    """Adam's bias-correction step count (equal for every parameter), wherever the optimizer keeps it."""
    for group in opt.param_groups:
        if "step" in group:
            return int(group["step"])
    for state in opt.state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def set_optimizer_step_count(opt: torch.optim.Optimizer, step: int) -> None:
    """Set Adam's step count where ``opt`` keeps it, on the device and dtype it keeps it in.

    torch's fused (and capturable) Adam keeps ``step`` as a tensor on the parameter's
    device, the others as a CPU tensor; apex's FusedAdam as a number in each param group.
    Missing per-parameter state (a resume before the first step) is created first, as
    Adam itself would create it.
    """
    in_groups = _steps_in_groups(opt)
    for group in opt.param_groups:
        if in_groups:
            group["step"] = step
        on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            state = opt.state[p]
            if not state:
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if in_groups:
                continue
            if torch.is_tensor(state.get("step")):
                state["step"].fill_(float(step))
            else:
                device = p.device if on_device else torch.device("cpu")
                state["step"] = torch.tensor(float(step), dtype=torch.float32, device=device)


def export_tensors(ds: DeepSpeedEngine) -> dict[str, dict[str, torch.Tensor]]:
    """fp32 master weights and Adam moments of every parameter, at this rank's TP shape, complete over DP."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out: dict[str, dict[str, torch.Tensor]] = {"param": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, p in ds.module.named_parameters():
        if uses_zero(ds):
            out["param"][name] = safe_get_full_fp32_param(p).detach().float().cpu()
            for key in ADAM_KEYS:
                out[key][name] = safe_get_full_optimizer_state(p, key).detach().float().cpu()
        else:
            out["param"][name] = host_copy(p)
            state = inner_optimizer(ds).state[p]
            for key in ADAM_KEYS:
                value = state.get(key)
                out[key][name] = torch.zeros_like(out["param"][name]) if value is None else host_copy(value)
    return out


def import_tensors(ds: DeepSpeedEngine, tensors: dict[str, dict[str, torch.Tensor]], step: int) -> None:
    """Weights and moments into the model and the optimizer; Adam's step count and the schedule to ``step``.

    ZeRO links each parameter to its fragment of the flat optimizer state only after
    the first step: creating the state and calling DeepSpeed's own lazy-initialisation
    hook links it now, so that a resume can set it before the first step.
    """
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    inner = inner_optimizer(ds)
    set_optimizer_step_count(inner, step)
    if hasattr(ds.optimizer, "_lazy_init_hp_params_optimizer_state"):
        ds.optimizer._lazy_init_hp_params_optimizer_state()
    for name, p in ds.module.named_parameters():
        value = tensors["param"][name].to(p.device)
        with torch.no_grad():
            p.copy_(value.to(p.dtype))
        if uses_zero(ds):
            safe_set_full_fp32_param(p, value)
            for key in ADAM_KEYS:
                safe_set_full_optimizer_state(p, tensors[key][name].to(p.device), key)
        else:
            state = inner.state[p]
            for key in ADAM_KEYS:
                state[key] = tensors[key][name].to(p.device, torch.float32).clone()
    # The scheduler follows the successful optimizer steps.
    rewind_schedule(ds.lr_scheduler, step)


def rewind_schedule(sched: torch.optim.lr_scheduler.LambdaLR, steps: int) -> None:
    """Set every param group's lr to the schedule's value after ``steps`` updates.

    torch warns when a scheduler steps before its optimizer ever did ("lr_scheduler.step()
    before optimizer.step()"), which is what setting a resumed schedule looks like; no
    value of the schedule is skipped here, so that warning is not shown to the user.
    """
    sched.last_epoch = steps - 1
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before", category=UserWarning
        )
        sched.step()
