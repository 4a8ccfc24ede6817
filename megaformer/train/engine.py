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

Where DeepSpeed would only add work (one replica, no pipeline, fp32 or bf16), ``train.optimizer``
picks :class:`megaformer.train.lean.LeanEngine` instead (:func:`optimizer_path`): the same
arithmetic and the same state, without DeepSpeed.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist

from megaformer.config import Config, TrainConfig, check_precision
from megaformer.errors import ConfigError, MegaformerWarning
from megaformer.parallel import ParallelContext
from megaformer.parallel.sharding import tp_dim
from megaformer.train.engine_state import (
    EngineState,
    adam_settings,
    export_tensors,
    import_tensors,
    inner_optimizer,
    lr_schedule,
    optimizer_step_count,
    uses_zero,
)
from megaformer.train.lean import LeanEngine, lean_refusal

LOG = logging.getLogger(__name__)

try:  # NVIDIA apex: fused Adam on GPUs when installed; never required.
    from apex.optimizers import FusedAdam as _ApexFusedAdam
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _ApexFusedAdam = None


# DeepSpeed's ZeRO calls a torch collective that torch marks deprecated, once per rank and
# run; the warning is not the user's to act on. Silenced only around DeepSpeed's own calls.
_DEEPSPEED_NOISE = r".*all_gather_into_tensor.* is deprecated"
# The memory reports DeepSpeed's bf16 optimizer prints as rank 0 builds it (forced: no setting turns
# them off): a heading, the accelerator's "MA ... GB" line and the host's "CPU Virtual Memory" line, four times.
_MEMORY_REPORT = re.compile(
    r"(begin|end) bf16_ ?optimizer|(before|after) initializing group \d+|MA [\d.]+ GB .*|CPU Virtual Memory: .*"
)
LOSS_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


class ModelParallelUnit:
    """The ``mpu`` DeepSpeed asks for: getters over our context, nothing global.

    The *model-parallel group* is Megatron's: the ranks that hold one replica (TP x PP).
    DeepSpeed sums gradient norms and agrees on fp16 overflow over it, so every pipeline
    stage clips by the same norm and skips the same steps. The model-parallel *rank* is
    the TP rank: DeepSpeed counts a replicated parameter's norm only where it is 0, which
    must be once per stage (each stage holds other parameters).
    """

    def __init__(self, ctx: ParallelContext) -> None:
        self.ctx = ctx

    def get_model_parallel_rank(self) -> int:
        return self.ctx.tp.rank

    def get_model_parallel_world_size(self) -> int:
        return self.ctx.tp.size * self.ctx.pp_size

    def get_model_parallel_group(self):
        return self.ctx.model_group

    def get_tensor_model_parallel_group(self):
        return self.ctx.tp.group

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.ctx.tp.size

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.ctx.pp_size

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.ctx.pp_rank

    def get_data_parallel_rank(self) -> int:
        return self.ctx.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.ctx.dp_size

    def get_data_parallel_group(self):
        return self.ctx.dp_group

    # Newer DeepSpeed releases ask for the TP rank with this name.
    get_tensor_model_parallel_rank = get_model_parallel_rank


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
        # bf16 has 8 bits of mantissa: gradients are reduced across DP ranks and summed over
        # micro-batches in fp32 (ZeRO-1 then runs DeepSpeed's BF16 optimizer; ZeRO-2 keeps
        # its bf16 gradient partitions but reduces in fp32).
        **(
            {"communication_data_type": "fp32", "data_types": {"grad_accum_dtype": "fp32"}}
            if t.precision == "bf16"
            else {}
        ),
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
    kwargs = adam_settings(t)
    if _ApexFusedAdam is not None and device.type == "cuda":
        return _ApexFusedAdam(model.parameters(), adam_w_mode=False, **kwargs)
    # torch's fused Adam (CPU and CUDA): one kernel over all tensors instead of a Python
    # loop of element-wise ops per tensor.
    return torch.optim.Adam(model.parameters(), fused=True, **kwargs)


@dataclass
class Engine(EngineState):
    """DeepSpeed's engine and what the loop needs beside it; the only code that touches DeepSpeed's internals.

    Stateful: :meth:`state_dict` / :meth:`load_state_dict` carry the fp32 weights, Adam's
    moments and step count, DeepSpeed's step counters and the fp16 loss scaler.
    """

    ds: object  # deepspeed.DeepSpeedEngine
    accumulation: int
    ctx: ParallelContext
    last_grad_norm: torch.Tensor | None = None  # ours, when DeepSpeed computes none (on the device)

    @property
    def module(self) -> torch.nn.Module:
        return self.ds.module

    @property
    def lr_scheduler(self) -> torch.optim.lr_scheduler.LambdaLR:
        return self.ds.lr_scheduler

    def describe(self) -> str:
        """The optimizer path, for the run's log line."""
        return f"deepspeed zero={self.ds.zero_optimization_stage()}"

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken, fp16 overflow steps included."""
        return self.ds.global_steps

    @property
    def skipped_steps(self) -> int:
        return self.ds.skipped_steps

    @property
    def optimizer_steps(self) -> int:
        """Successful optimizer updates so far (skipped fp16 overflow steps excluded)."""
        return self.ds.global_steps - self.ds.skipped_steps

    def train(self) -> None:
        self.ds.train()

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        """DeepSpeed's backward (loss scaling, gradient reduction at the accumulation boundary).

        ``scale_wrt_gas=False`` for a scalar whose gradient is already divided by the
        accumulation steps (a pipeline stage's surrogate of its received gradients).
        """
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_DEEPSPEED_NOISE, category=FutureWarning)
            # DeepSpeed runs its optimizer's backward prologue from hooks that its own forward puts on the
            # outputs; the model is called directly here, so it is run here. For the bf16 optimizer it clears
            # the bf16 gradients of the previous micro-batch, which are already in its fp32 sums: without it
            # micro-batch k was counted (accumulation - k) times.
            prologue = getattr(self.ds.optimizer, "backward_prologue", None)
            if uses_zero(self.ds) and callable(prologue):
                prologue()
            self.ds.backward(loss, scale_wrt_gas=scale_wrt_gas)

    def set_boundary(self, last: bool) -> None:
        """Say whether the next backward is the step's last (a pipeline runs every backward before one step)."""
        self.ds.set_gradient_accumulation_boundary(last)

    def step(self) -> None:
        """DeepSpeed's step: the optimizer update at the last micro-batch of an accumulation."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_DEEPSPEED_NOISE, category=FutureWarning)
            self.ds.step()

    def lr(self) -> float:
        return self.ds.get_lr()[0]

    def loss_scale(self) -> float:
        opt = self.ds.optimizer
        scale = getattr(opt, "cur_scale", None) or getattr(getattr(opt, "loss_scaler", None), "cur_scale", None)
        return float(scale) if scale is not None else 1.0

    def grad_norm_on_device(self) -> torch.Tensor | float | None:
        """:meth:`grad_norm` as DeepSpeed or :meth:`note_grad_norm` left it: a device tensor (or a float), unread."""
        norm = self.ds.get_global_grad_norm()
        return norm if norm is not None else self.last_grad_norm

    def note_grad_norm(self) -> None:
        """Without ZeRO DeepSpeed keeps no norm (with clipping it computes one and drops it): compute it, unread,
        so that a non-finite gradient stops the run (call after the last backward)."""
        if uses_zero(self.ds):
            return
        grads = [(p.grad.detach(), tp_dim(p) is not None) for p in self.module.parameters() if p.grad is not None]

        def square_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
            """The squared norm of ``tensors`` together, in fp64 (each tensor's norm by torch's foreach kernels)."""
            if not tensors:
                return torch.zeros((), dtype=torch.float64, device=self.ctx.device)
            return torch.nn.utils.get_total_norm(tensors, 2.0).double().square()

        split = square_norm([g for g, is_split in grads if is_split])  # squares of TP-split tensors
        replicated = square_norm([g for g, is_split in grads if not is_split])
        if self.ctx.tp.size > 1:  # shards add up over the TP group; replicated tensors count once
            dist.all_reduce(split, group=self.ctx.tp.group)
        total = split + replicated
        if self.ctx.pp_size > 1:  # each stage holds other parameters (embedding copies are none)
            dist.all_reduce(total, group=self.ctx.pp_group)
        self.last_grad_norm = total.sqrt()

    # ---- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """``tensors``: fp32 weights and Adam moments at this rank's TP shape, complete over DP;
        ``counters``: step counts, the loss scaler and the lr schedule's cool-down (its start
        and length, or None) and fitted warm-up (its updates, or None). A collective over
        the DP group with ZeRO.
        """
        scaler = getattr(self.ds.optimizer, "loss_scaler", None)
        fields = {k: getattr(scaler, k) for k in LOSS_SCALER_FIELDS if scaler is not None and hasattr(scaler, k)}
        return {
            "tensors": export_tensors(self.ds),
            "counters": {
                "global_steps": self.ds.global_steps,
                "skipped_steps": self.ds.skipped_steps,
                "optimizer_steps": optimizer_step_count(inner_optimizer(self.ds)),
                "loss_scaler": {k: (v.item() if torch.is_tensor(v) else v) for k, v in fields.items()},
                **self.schedule_counters(),
            },
        }

    def load_state_dict(self, state: dict) -> None:
        """Load :meth:`state_dict` (tensors at this rank's TP shape) into the model, optimizer and DeepSpeed."""
        counters = state["counters"]
        import_tensors(self.ds, state["tensors"], counters["optimizer_steps"])
        ds = self.ds
        ds.global_steps, ds.skipped_steps = counters["global_steps"], counters["skipped_steps"]
        ds.global_samples = counters["global_steps"] * self.accumulation * self.ctx.dp_size
        scaler = getattr(ds.optimizer, "loss_scaler", None)
        for name, value in counters.get("loss_scaler", {}).items():
            if scaler is not None and hasattr(scaler, name):
                setattr(scaler, name, value)
        self.load_schedule(counters)


SHM_OP = "deepspeed_shm_comm"  # DeepSpeed's ShareMemCommBuilder.NAME


@contextlib.contextmanager
def _without_shm_op():
    """DeepSpeed's communication backend without its shared-memory op, which it JIT-compiles on a CPU.

    The op serves only ``inference_all_reduce``, which megaformer never calls; building
    it took ~45 s on a machine's first run and loading it ~8 s on every later one.
    """
    import deepspeed.ops

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if not isinstance(compatible, dict):
        yield
        return
    saved = compatible.get(SHM_OP, False)
    compatible[SHM_OP] = False
    try:
        yield
    finally:
        compatible[SHM_OP] = saved


def optimizer_path(cfg: Config, ctx: ParallelContext) -> str:
    """``train.optimizer`` for this run: "lean" or "deepspeed" ("auto": lean for one replica without a pipeline
    in fp32 or bf16 on a GPU); a ConfigError where lean is asked for and cannot run."""
    why_not = lean_refusal(cfg, ctx)
    if cfg.train.optimizer == "lean" and why_not is not None:
        raise ConfigError(why_not)
    if cfg.train.optimizer == "auto":
        return "lean" if why_not is None and ctx.device.type == "cuda" else "deepspeed"
    return cfg.train.optimizer


def build_engine(cfg: Config, ctx: ParallelContext, model: torch.nn.Module, accumulation: int) -> Engine | LeanEngine:
    """Wrap ``model`` (already on ``ctx.device``) in the engine ``train.optimizer`` picks (:func:`optimizer_path`):
    DeepSpeed configured from ``cfg``, or the lean engine."""
    if optimizer_path(cfg, ctx) == "lean":
        return LeanEngine.create(cfg, ctx, model, accumulation)
    _use_accelerator_of(ctx.device)
    import deepspeed

    ds_config = deepspeed_config(cfg, ctx.dp_size, accumulation, ctx.device.type)
    with _without_shm_op():
        deepspeed.init_distributed(
            dist_backend=ctx.backend if ctx.backend != "none" else "gloo", auto_mpi_discovery=False, verbose=False
        )
    _tag_model_parallel(model, ctx)
    optimizer = _optimizer(model, cfg.train, ctx.device)
    lr_scheduler = lr_schedule(cfg, optimizer)
    fp16_on_cpu = cfg.train.precision == "fp16" and ctx.device.type == "cpu"
    with _fp16_allowed_on_cpu() if fp16_on_cpu else contextlib.nullcontext(), _memory_reports_dropped():
        ds, _, _, _ = deepspeed.initialize(
            args=_device_args(ctx.device),
            model=model,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            config=ds_config,
            mpu=ModelParallelUnit(ctx),
        )
    return Engine(ds=ds, accumulation=ds_config["gradient_accumulation_steps"], ctx=ctx)


@contextlib.contextmanager
def _memory_reports_dropped() -> Iterator[None]:
    """What DeepSpeed prints while the block runs, less its bf16 optimizer's memory reports (12 lines a start).

    Its logger's records are not held back: its handler writes to the stream it was made with.
    """
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            yield
    finally:
        kept = [line for line in printed.getvalue().splitlines() if not _MEMORY_REPORT.fullmatch(line.strip())]
        if kept:
            LOG.info("\n".join(kept))


def _device_args(device: torch.device) -> SimpleNamespace | None:
    """Tell DeepSpeed the rank's GPU: by default it takes ``cuda:<LOCAL_RANK>``, which does not exist when
    ranks share a GPU (gloo, ``parallel.device=cuda``) or a task sees only its own GPU as ``cuda:0``."""
    return SimpleNamespace(device_rank=device.index) if device.type == "cuda" and device.index is not None else None


def _use_accelerator_of(device: torch.device) -> None:
    """DeepSpeed picks CUDA whenever it is visible; a run on the CPU (gloo) must tell it, before it builds anything.

    Told before DeepSpeed's first import too, which otherwise looks for a GPU and warns that it found none.
    """
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if device.type == "cpu" and get_accelerator().device_name() != "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())


@contextlib.contextmanager
def _fp16_allowed_on_cpu() -> Iterator[None]:
    """DeepSpeed refuses fp16 on a CPU without native fp16 matmul (oneDNN); torch still computes it.

    For testing the fp16 path (loss scaling, overflow skips) on CPU machines: slow
    there, and a GPU or bf16 is what to train with. DeepSpeed's accelerator is patched
    only while the engine is built, and restored after.
    """
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.is_fp16_supported():
        yield
        return
    warnings.warn(
        "fp16 on a CPU without native fp16 support: emulated by torch, for testing only",
        MegaformerWarning,
        stacklevel=3,
    )
    supported = accelerator.supported_dtypes()
    accelerator.is_fp16_supported = lambda: True
    accelerator.supported_dtypes = lambda: list(dict.fromkeys([*supported, torch.float16]))
    try:
        yield
    finally:
        del accelerator.is_fp16_supported, accelerator.supported_dtypes  # back to the class's methods


# ---- optimizer state, per parameter -----------------------------------------------------------
