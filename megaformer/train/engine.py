"""The DeepSpeed engine, built from our config (never from a second hand-kept JSON).

DeepSpeed drives the optimizer step: ZeRO stage 0/1/2 over the data-parallel group
only (a model-parallel unit over our :class:`ParallelContext` tells it the groups),
fp16 with dynamic loss scaling, bf16 or fp32, gradient accumulation and clipping that
counts tensor-parallel shards once. Batch sizes follow from ``train.tokens_per_step``:
each micro-batch holds at most ``data.max_tokens`` tokens per side, and about
``tokens_per_step / (dp * max_tokens)`` micro-batches per rank make one optimizer
step (:class:`megaformer.train.feed.DataFeed` decides the exact count).

The optimizer's fp32 state is read and written per parameter (at this rank's TP
shape, complete over DP) through DeepSpeed's ``safe_get/set_full_*`` functions, which
is what makes checkpoints independent of the DP size and ZeRO stage.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megaformer.config import Config, TrainConfig
from megaformer.errors import ConfigError
from megaformer.parallel import ParallelContext
from megaformer.parallel.sharding import tp_dim
from megaformer.train.schedule import InverseSqrtSchedule

try:  # NVIDIA apex: fused Adam on GPUs when installed; never required.
    from apex.optimizers import FusedAdam as _ApexFusedAdam
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _ApexFusedAdam = None

ADAM_KEYS = ("exp_avg", "exp_avg_sq")

# DeepSpeed's ZeRO calls a torch collective that torch marks deprecated, once per rank and
# run; the warning is not the user's to act on.
warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)


class ModelParallelUnit:
    """The ``mpu`` DeepSpeed asks for: getters over our context, nothing global."""

    def __init__(self, ctx: ParallelContext) -> None:
        self.ctx = ctx

    def get_model_parallel_rank(self) -> int:
        return self.ctx.tp.rank

    def get_model_parallel_world_size(self) -> int:
        return self.ctx.tp.size

    def get_model_parallel_group(self):
        return self.ctx.tp.group

    def get_data_parallel_rank(self) -> int:
        return self.ctx.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.ctx.dp_size

    def get_data_parallel_group(self):
        return self.ctx.dp_group

    # Newer DeepSpeed releases ask with these names.
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group


def check_precision(train: TrainConfig) -> None:
    if train.precision in ("bf16", "fp16") and train.zero_stage == 0:
        raise ConfigError(
            f"train.precision={train.precision} keeps fp32 master weights in DeepSpeed's ZeRO optimizer: "
            f"set train.zero_stage=1 (with one data-parallel rank it shards nothing)"
        )


def deepspeed_config(cfg: Config, dp: int, accum: int, device_type: str = "cuda") -> dict:
    """The DeepSpeed config, generated: one source of truth for batch size and precision.

    ``accum``: micro-batches per rank per optimizer step; ``device_type``: "cuda" or "cpu".
    """
    t = cfg.train
    check_precision(t)
    bucket = t.zero_bucket_size
    contiguous = (
        device_type == "cuda" if t.zero_contiguous_gradients == "auto" else t.zero_contiguous_gradients == "true"
    )
    return {
        # A "sample" is one token-bounded micro-batch: train_batch_size counts micro-batches.
        "train_batch_size": accum * dp,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": t.clip_grad,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": t.zero_stage,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            "overlap_comm": t.zero_overlap_comm,
            "contiguous_gradients": contiguous,
            "reduce_scatter": t.zero_reduce_scatter,
        },
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {
            "enabled": t.precision == "fp16",
            "loss_scale": 0,  # dynamic
            "initial_scale_power": t.fp16_initial_scale_power,
            "loss_scale_window": 1000,
            "hysteresis": t.fp16_hysteresis,
            "min_loss_scale": 1,
        },
    }


def _tag_model_parallel(model: torch.nn.Module, ctx: ParallelContext) -> None:
    """Mark TP-split parameters so DeepSpeed's gradient norm sums them over the TP group once."""
    for p in model.parameters():
        p.tensor_model_parallel = ctx.tp.size > 1 and tp_dim(p) is not None


def _optimizer(model: torch.nn.Module, t: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    kwargs = dict(lr=1.0, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay)
    if _ApexFusedAdam is not None and device.type == "cuda":
        return _ApexFusedAdam(model.parameters(), adam_w_mode=False, **kwargs)
    # torch's fused Adam (CPU and CUDA): one kernel over all tensors instead of a Python
    # loop of element-wise ops per tensor.
    return torch.optim.Adam(model.parameters(), fused=True, **kwargs)


@dataclass
class Engine:
    """DeepSpeed's engine and what the loop needs beside it."""

    ds: object  # deepspeed.DeepSpeedEngine
    accumulation: int
    ctx: ParallelContext
    last_grad_norm: float = float("nan")

    @property
    def module(self) -> torch.nn.Module:
        return self.ds.module

    @property
    def optimizer_steps(self) -> int:
        """Successful optimizer updates so far (skipped fp16 overflow steps excluded)."""
        return self.ds.global_steps - self.ds.skipped_steps

    def lr(self) -> float:
        return self.ds.get_lr()[0]

    def loss_scale(self) -> float:
        opt = self.ds.optimizer
        scale = getattr(opt, "cur_scale", None) or getattr(getattr(opt, "loss_scaler", None), "cur_scale", None)
        return float(scale) if scale is not None else 1.0

    def grad_norm(self) -> float:
        """The global gradient norm of the last step (DeepSpeed's, or ours without ZeRO and clipping)."""
        norm = self.ds.get_global_grad_norm()
        return float(norm) if norm is not None else self.last_grad_norm

    def note_grad_norm(self) -> None:
        """Without ZeRO or clipping DeepSpeed computes no norm: compute it (call after the last backward)."""
        if _zero(self) or self.ds.gradient_clipping() > 0:
            return
        split, replicated = 0.0, 0.0
        for p in self.module.parameters():
            if p.grad is not None:
                sq = float(p.grad.detach().float().pow(2).sum())
                if tp_dim(p) is not None:
                    split += sq
                else:
                    replicated += sq
        total = torch.tensor([split], dtype=torch.float64, device=self.ctx.device)
        if self.ctx.tp.size > 1:  # shards add up over the TP group; replicated tensors count once
            dist.all_reduce(total, group=self.ctx.tp.group)
        self.last_grad_norm = float(total.item() + replicated) ** 0.5


def build_engine(cfg: Config, ctx: ParallelContext, model: torch.nn.Module, accumulation: int) -> Engine:
    """Wrap ``model`` (already on ``ctx.device``) in a DeepSpeed engine configured from ``cfg``."""
    import deepspeed

    ds_config = deepspeed_config(cfg, ctx.dp_size, accumulation, ctx.device.type)
    if cfg.train.precision == "fp16" and ctx.device.type == "cpu":
        _allow_fp16_on_cpu()
    deepspeed.init_distributed(
        dist_backend=ctx.backend if ctx.backend != "none" else "gloo", auto_mpi_discovery=False, verbose=False
    )
    _tag_model_parallel(model, ctx)
    optimizer = _optimizer(model, cfg.train, ctx.device)
    schedule = InverseSqrtSchedule(cfg.model.d_model, cfg.train.warmup_steps, cfg.train.lr_scale)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    ds, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, config=ds_config, mpu=ModelParallelUnit(ctx)
    )
    return Engine(ds=ds, accumulation=ds_config["gradient_accumulation_steps"], ctx=ctx)


def _allow_fp16_on_cpu() -> None:
    """DeepSpeed refuses fp16 on a CPU without native fp16 matmul (oneDNN); torch still computes it.

    Used for testing the fp16 path (loss scaling, overflow skips) on CPU machines; it is
    slow there, and a GPU or bf16 is what to train with.
    """
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if not accelerator.is_fp16_supported():
        warnings.warn("fp16 on a CPU without native fp16 support: emulated by torch, for testing only", stacklevel=2)
        accelerator.is_fp16_supported = lambda: True
        if torch.float16 not in accelerator.supported_dtypes():
            supported = accelerator.supported_dtypes()
            accelerator.supported_dtypes = lambda: supported + [torch.float16]


# ---- optimizer state, per parameter -----------------------------------------------------------


def _plain_state(engine: Engine, p: torch.nn.Parameter) -> dict:
    return engine.ds.optimizer.state[p]


def _zero(engine: Engine) -> bool:
    return engine.ds.zero_optimization_stage() > 0


def export_state(engine: Engine) -> dict[str, dict[str, torch.Tensor]]:
    """fp32 master weights and Adam moments of every parameter, at this rank's TP shape, complete over DP.

    A collective over the DP group with ZeRO: every rank must call it.
    """
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out: dict[str, dict[str, torch.Tensor]] = {"param": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, p in engine.module.named_parameters():
        if _zero(engine):
            out["param"][name] = safe_get_full_fp32_param(p).detach().float().cpu()
            for key in ADAM_KEYS:
                out[key][name] = safe_get_full_optimizer_state(p, key).detach().float().cpu()
        else:
            out["param"][name] = p.detach().float().cpu().clone()
            state = _plain_state(engine, p)
            for key in ADAM_KEYS:
                out[key][name] = (
                    state[key].detach().float().cpu().clone() if key in state else torch.zeros_like(out["param"][name])
                )
    return out


def adam_step(engine: Engine) -> int:
    """Adam's bias-correction step count (equal for every parameter)."""
    opt = engine.ds.optimizer
    inner = getattr(opt, "optimizer", opt)
    for state in inner.state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def _create_optimizer_state(engine: Engine) -> None:
    """Adam creates its moments at the first step; a resume sets them before it, so make them now.

    ZeRO links each parameter to its fragment of the flat optimizer state only after
    the first step too: link it (DeepSpeed's own lazy-initialisation hook).
    """
    opt = engine.ds.optimizer
    inner = getattr(opt, "optimizer", opt)
    for group in inner.param_groups:
        for p in group["params"]:
            if not inner.state.get(p):
                inner.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        opt._lazy_init_hp_params_optimizer_state()


def import_state(engine: Engine, state: dict[str, dict[str, torch.Tensor]], step: int) -> None:
    """Load :func:`export_state` tensors (this rank's TP shape) into the model and the optimizer."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    _create_optimizer_state(engine)
    inner = getattr(engine.ds.optimizer, "optimizer", engine.ds.optimizer)
    for name, p in engine.module.named_parameters():
        value = state["param"][name].to(p.device)
        with torch.no_grad():
            p.copy_(value.to(p.dtype))
        if _zero(engine):
            safe_set_full_fp32_param(p, value)
            for key in ADAM_KEYS:
                safe_set_full_optimizer_state(p, state[key][name].to(p.device), key)
        else:
            s = inner.state[p]
            for key in ADAM_KEYS:
                s[key] = state[key][name].to(p.device, torch.float32).clone()
            s["step"] = torch.tensor(float(step))
    if _zero(engine):
        for s in inner.state.values():
            if "step" in s:
                s["step"] = torch.tensor(float(step)) if torch.is_tensor(s["step"]) else step
    # The scheduler follows the successful optimizer steps.
    sched = engine.ds.lr_scheduler
    sched.last_epoch = step - 1
    sched.step()
