"""The lean engine: one replica (dp = 1) without a pipeline, in fp32 or bf16, without DeepSpeed.

At one data-parallel rank DeepSpeed adds work and no function: its bf16 optimizer
flattens every weight, loops over the parameters in Python at each step and reads the
gradient norm back to the host to check it. :class:`LeanEngine` does DeepSpeed's
arithmetic with torch's fused Adam and ``torch._foreach_*`` ops and reads nothing back:

- fp32: Adam updates the model's own parameters; autograd sums the micro-batches'
  gradients in ``.grad``, each loss divided by the accumulation (DeepSpeed's
  ``scale_wrt_gas``), and the gradients are dropped after the update.
- bf16: the model holds bf16 weights (cast as DeepSpeed casts them: parameters only),
  Adam an fp32 master of each. After every backward the bf16 gradients are added into
  fp32 sums and dropped, as DeepSpeed's BF16_Optimizer accumulates them; Adam steps the
  masters on the sums, and the bf16 weights are copied from the masters.

The gradient norm is DeepSpeed's (each gradient's fp32 norm, the squares summed, a TP-split
gradient on every TP rank and a replicated one on TP rank 0 only, over the TP group). It
is computed on the device for the finite check (:meth:`LeanEngine.note_grad_norm`) and
for ``train.clip_grad``, which multiplies the gradients by ``clip / (norm + 1e-6)`` where
that is below 1, on the device, rounded as DeepSpeed rounds it in fp32 without ZeRO and in
bf16 (its fp32 ZeRO optimizer rounds a third way). No update is skipped: a non-finite norm
stops the run (the trainer's finite check) before anything is saved. The state is the
DeepSpeed engine's (:mod:`megaformer.train.engine_state`): either resumes the other's checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.optim import optimizer as torch_optimizer

from megaformer.config import Config
from megaformer.errors import ConfigError
from megaformer.parallel import ParallelContext
from megaformer.parallel.layout import lean_refusal as layout_refusal
from megaformer.parallel.sharding import tp_dim
from megaformer.train.engine_state import (
    ADAM_KEYS,
    EngineState,
    adam_settings,
    host_copy,
    lr_schedule,
    optimizer_step_count,
    set_optimizer_step_count,
)


def lean_refusal(cfg: Config, ctx: ParallelContext) -> str | None:
    """Why the lean engine cannot train this run (None: it can): it holds one replica of the whole model."""
    return layout_refusal(cfg.train.precision, ctx.dp_size, ctx.pp_size)


def _fused_on(device: torch.device) -> bool:
    """Whether torch's fused Adam runs on ``device`` (the meta device only where a caller adds it, as the step
    recorder of :mod:`megaformer.sim.step` does; elsewhere there Adam runs its foreach form)."""
    return device.type in torch_optimizer._get_fused_kernels_supported_devices()


@dataclass(eq=False)
class LeanEngine(EngineState):
    """The engine interface of :class:`megaformer.train.engine.Engine` over torch's fused Adam (see the module)."""

    module: torch.nn.Module
    accumulation: int
    ctx: ParallelContext
    optimizer: torch.optim.Adam
    lr_scheduler: torch.optim.lr_scheduler.LambdaLR
    params: list[torch.Tensor]  # the module's parameters, in named_parameters() order
    masters: list[torch.Tensor]  # what Adam updates: ``params`` in fp32, their fp32 copies in bf16
    sums: list[torch.Tensor] | None  # bf16: each parameter's fp32 gradient sum over the step (Adam's grads)
    clip_grad: float = 0.0
    global_steps: int = 0
    skipped_steps: int = 0  # never one here; a DeepSpeed checkpoint's count is kept
    micro_steps: int = 0
    last_grad_norm: torch.Tensor | None = None  # of the last step, on the device
    _boundary: bool | None = field(default=None, init=False)  # set_boundary's word; None: count micro-batches
    _norm_is_current: bool = field(default=False, init=False)  # last_grad_norm is of this step's gradients
    _summed: list[bool] = field(default_factory=list, init=False)  # bf16: which sums got a gradient this step

    @classmethod
    def create(cls, cfg: Config, ctx: ParallelContext, model: torch.nn.Module, accumulation: int) -> LeanEngine:
        """The engine over ``model`` (on its device, which every tensor here is made on). In bf16 its fp32
        parameters become bf16 (buffers stay), and the masters start from them, as DeepSpeed's do."""
        if (why := lean_refusal(cfg, ctx)) is not None:
            raise ConfigError(why)
        t = cfg.train
        params = list(model.parameters())
        sums = None
        if t.precision == "bf16":
            for p in params:
                if p.dtype == torch.float32:
                    p.data = p.data.to(torch.bfloat16)
            masters = [p.detach().to(torch.float32, copy=True) for p in params]
            sums = [torch.zeros_like(m) for m in masters]
            for master, total in zip(masters, sums, strict=True):
                master.grad = total
        else:
            masters = params
        fused = _fused_on(params[0].device)
        optimizer = torch.optim.Adam(masters, fused=fused, foreach=not fused, **adam_settings(t))
        return cls(model, accumulation, ctx, optimizer, lr_schedule(cfg, optimizer), params, masters, sums, t.clip_grad)

    def __post_init__(self) -> None:
        self._summed = [False] * len(self.params)

    @property
    def optimizer_steps(self) -> int:
        """Successful optimizer updates so far (a DeepSpeed checkpoint's skipped fp16 steps excluded)."""
        return self.global_steps - self.skipped_steps

    def describe(self) -> str:
        """The optimizer path, for the run's log line."""
        return "lean optimizer"

    def train(self) -> None:
        self.module.train()

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        """Back-propagate ``loss`` divided by the accumulation (``scale_wrt_gas=False``: as it is); in bf16 the
        gradients are then added into their fp32 sums and dropped."""
        (loss / self.accumulation if scale_wrt_gas else loss).backward()
        self._norm_is_current = False
        if self.sums is None:
            return
        # A parameter's first gradient of the step is copied into its sum (a stale sum from the last step
        # is replaced; torch's fused copy converts bf16 to fp32), later ones are added (a kernel each: torch
        # fuses no addition of another dtype); bitwise DeepSpeed's zeroed sum plus each gradient.
        first = [i for i, p in enumerate(self.params) if p.grad is not None and not self._summed[i]]
        later = [i for i, p in enumerate(self.params) if p.grad is not None and self._summed[i]]
        with torch.no_grad():
            for combine, indices in ((torch._foreach_copy_, first), (torch._foreach_add_, later)):
                if indices:
                    combine([self.sums[i] for i in indices], [self.params[i].grad for i in indices])
        for i in first + later:
            self.params[i].grad = None
            self._summed[i] = True

    def set_boundary(self, last: bool) -> None:
        """Say whether the next backward is the step's last (without it, every ``accumulation``-th step is)."""
        self._boundary = last

    def step(self) -> None:
        """The update, at the last micro-batch of an accumulation; nothing before it."""
        last = self._boundary if self._boundary is not None else (self.micro_steps + 1) % self.accumulation == 0
        if last:
            self._update()
        self.micro_steps += 1

    @torch.no_grad()
    def _update(self) -> None:
        """Clip, step Adam and the schedule, then drop the gradients (bf16: copy the weights from the masters)."""
        if self.sums is not None and (stale := [s for s, got in zip(self.sums, self._summed) if not got]):
            torch._foreach_zero_(stale)  # no gradient this step: Adam steps on a zero one, as DeepSpeed's does
        grads = [g for _, g in self._gradients()]
        if self.clip_grad > 0 and grads:
            if not self._norm_is_current:
                self.note_grad_norm()
            torch._foreach_mul_(grads, torch.clamp(self._clip_coefficient(), max=1.0))  # x 1.0: left as they are
        self.optimizer.step()
        self.lr_scheduler.step()
        if self.sums is None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            torch._foreach_copy_(self.params, self.masters)  # fp32 to bf16 in one fused kernel
            self._summed = [False] * len(self.sums)
        self.global_steps += 1
        self._norm_is_current = False

    def _clip_coefficient(self) -> torch.Tensor:
        """``clip / (norm + 1e-6)``, rounded as DeepSpeed's optimizer of the precision rounds it: fp32 without ZeRO
        divides, the bf16 optimizer multiplies by the reciprocal (a number over a tensor)."""
        shifted = self.last_grad_norm + 1e-6
        return torch.full_like(shifted, self.clip_grad) / shifted if self.sums is None else self.clip_grad / shifted

    def _gradients(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, its gradient summed over the step so far) for each parameter that got one."""
        if self.sums is None:
            return [(p, p.grad) for p in self.params if p.grad is not None]
        return [(p, total) for p, total, got in zip(self.params, self.sums, self._summed, strict=True) if got]

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def loss_scale(self) -> float:
        return 1.0

    def grad_norm_on_device(self) -> torch.Tensor | None:
        """The last :meth:`note_grad_norm`, a 0-dim fp32 tensor on the device, unread."""
        return self.last_grad_norm

    def note_grad_norm(self) -> None:
        """The step's global gradient norm, on the device and unread (call after the last backward)."""
        tp = self.ctx.tp
        counted = [g for p, g in self._gradients() if tp.rank == 0 or (tp.size > 1 and tp_dim(p) is not None)]
        if counted:
            squares = torch.stack(torch._foreach_norm(counted)).pow(2).sum()
        else:
            squares = torch.zeros((), dtype=torch.float32, device=self.params[0].device)
        if tp.size > 1:  # shards add up over the TP group; a replicated tensor counted on TP rank 0 only
            dist.all_reduce(squares, group=tp.group)
        self.last_grad_norm = squares.pow(0.5)
        self._norm_is_current = True

    # ---- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """:meth:`megaformer.train.engine.Engine.state_dict`'s format: ``tensors`` (fp32 weights and Adam moments
        as CPU tensors) and ``counters`` (no loss scaler in fp32 or bf16)."""
        tensors: dict[str, dict[str, torch.Tensor]] = {"param": {}, **{key: {} for key in ADAM_KEYS}}
        for (name, _), master in zip(self.module.named_parameters(), self.masters, strict=True):
            tensors["param"][name] = host_copy(master)
            state = self.optimizer.state[master]
            for key in ADAM_KEYS:
                tensors[key][name] = host_copy(state[key]) if key in state else torch.zeros_like(tensors["param"][name])
        counters = {
            "global_steps": self.global_steps,
            "skipped_steps": self.skipped_steps,
            "optimizer_steps": optimizer_step_count(self.optimizer),
            "loss_scaler": {},
            **self.schedule_counters(),
        }
        return {"tensors": tensors, "counters": counters}

    def load_state_dict(self, state: dict) -> None:
        """Load a state of either engine (tensors at this rank's TP shape) into the masters, the weights and Adam."""
        tensors, counters = state["tensors"], state["counters"]
        set_optimizer_step_count(self.optimizer, counters["optimizer_steps"])
        with torch.no_grad():
            for (name, _), master in zip(self.module.named_parameters(), self.masters, strict=True):
                master.copy_(tensors["param"][name])
                adam = self.optimizer.state[master]
                for key in ADAM_KEYS:
                    adam[key] = tensors[key][name].to(master.device, torch.float32).clone()
            if self.sums is not None:
                torch._foreach_copy_(self.params, self.masters)
        self.global_steps, self.skipped_steps = counters["global_steps"], counters["skipped_steps"]
        self.load_schedule(counters)
