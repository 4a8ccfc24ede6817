"""The engine's tensors in and out of DeepSpeed: weights, Adam moments and step counts, at this rank's TP shape.

Part of :mod:`megaformer.train.engine` (the only code touching DeepSpeed's internals):
``export_tensors`` gathers fp32 weights and Adam moments complete over DP (ZeRO
partitions included), ``import_tensors`` puts them back, and the optimizer's step count
is read and set where each optimizer keeps it (torch's fused Adam: a tensor on the
parameter's device; apex's and DeepSpeed's FusedAdam: a number in each param group).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megaformer.train.engine import Engine

ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def inner_optimizer(engine: Engine) -> torch.optim.Optimizer:
    """The optimizer that holds Adam's state (inside DeepSpeed's ZeRO wrapper, if any)."""
    opt = engine.ds.optimizer
    return getattr(opt, "optimizer", opt)


def uses_zero(engine: Engine) -> bool:
    return engine.ds.zero_optimization_stage() > 0


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


def export_tensors(engine: Engine) -> dict[str, dict[str, torch.Tensor]]:
    """fp32 master weights and Adam moments of every parameter, at this rank's TP shape, complete over DP."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out: dict[str, dict[str, torch.Tensor]] = {"param": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, p in engine.module.named_parameters():
        if uses_zero(engine):
            out["param"][name] = safe_get_full_fp32_param(p).detach().float().cpu()
            for key in ADAM_KEYS:
                out[key][name] = safe_get_full_optimizer_state(p, key).detach().float().cpu()
        else:
            out["param"][name] = p.detach().float().cpu().clone()
            state = inner_optimizer(engine).state[p]
            for key in ADAM_KEYS:
                value = state.get(key)
                out[key][name] = torch.zeros_like(out["param"][name]) if value is None else value.detach().float().cpu()
    return out


def import_tensors(engine: Engine, tensors: dict[str, dict[str, torch.Tensor]], step: int) -> None:
    """Weights and moments into the model and the optimizer; Adam's step count and the schedule to ``step``.

    ZeRO links each parameter to its fragment of the flat optimizer state only after
    the first step: creating the state and calling DeepSpeed's own lazy-initialisation
    hook links it now, so that a resume can set it before the first step.
    """
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    inner = inner_optimizer(engine)
    set_optimizer_step_count(inner, step)
    if hasattr(engine.ds.optimizer, "_lazy_init_hp_params_optimizer_state"):
        engine.ds.optimizer._lazy_init_hp_params_optimizer_state()
    for name, p in engine.module.named_parameters():
        value = tensors["param"][name].to(p.device)
        with torch.no_grad():
            p.copy_(value.to(p.dtype))
        if uses_zero(engine):
            safe_set_full_fp32_param(p, value)
            for key in ADAM_KEYS:
                safe_set_full_optimizer_state(p, tensors[key][name].to(p.device), key)
        else:
            state = inner.state[p]
            for key in ADAM_KEYS:
                state[key] = tensors[key][name].to(p.device, torch.float32).clone()
    # The scheduler follows the successful optimizer steps.
    rewind_schedule(engine.ds.lr_scheduler, step)


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
