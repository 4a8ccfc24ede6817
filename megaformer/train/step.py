"""One optimizer step of the training loop: back-propagate a step's micro-batches, then step.

Without pipeline stages (:func:`accumulate`) each micro-batch runs forward and backward
in turn; with them (:func:`pipeline_step`) the 1F1B schedule of
:mod:`megaformer.pipeline.schedule` runs every micro-batch of the step before the one
optimizer step. Both scale each micro-batch's summed loss by ``accumulation x dp /
tokens`` (see :mod:`megaformer.train.trainer`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from megaformer.parallel import ParallelContext
from megaformer.pipeline.schedule import Pipeline, PipeMicroBatch
from megaformer.pipeline.stage import StageBatch
from megaformer.train.engine import Engine
from megaformer.train.feed import DataFeed, MicroBatch
from megaformer.train.signals import NONE, REQUEUE, TERMINATE


def world_sum(ctx: ParallelContext, values: list[float], on_device: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """Sum over every rank of ``values`` (from the host), then of the scalars ``on_device``: one float64 tensor on
    the device, not read back. TP peers hold equal values, so a DP sum is this divided by tp.

    The host's values go to the device through pinned memory on a GPU, and nccl reduces on
    the device's stream: nothing here waits for the device (gloo with CUDA tensors does).
    """
    host = torch.tensor(values, dtype=torch.float64, device="cpu")
    summed = (host.pin_memory() if ctx.device.type == "cuda" else host).to(ctx.device, non_blocking=True)
    if on_device:
        summed = torch.cat([summed, torch.stack([v.detach().to(torch.float64).reshape(()) for v in on_device])])
    if dist.is_initialized():
        dist.all_reduce(summed, group=ctx.world_group)
    return summed


def accumulate(
    engine: Engine,
    micro: Sequence[MicroBatch],
    tokens: float | torch.Tensor,
    label_smoothing: float,
    dropout_of: Callable[[int], AbstractContextManager],
) -> torch.Tensor:
    """Back-propagate each micro-batch of one optimizer step and step; returns this rank's summed loss.

    ``tokens``: the step's target tokens summed over the DP group. Each micro-batch's
    summed loss is scaled by ``accumulation x dp / tokens``: DeepSpeed divides by the
    accumulation steps and averages over DP, so the update follows the mean loss per
    target token of the whole step. ``dropout_of(stream)`` switches the model's dropout
    streams to those of the data stream a micro-batch came from. The loss stays on the
    device, and so may ``tokens`` (no host synchronisation in the step).
    """
    if len(micro) != engine.accumulation:
        raise RuntimeError(f"{len(micro)} micro-batches for an accumulation of {engine.accumulation}")
    share = engine.accumulation * engine.ctx.dp_size
    # On the device a true division (a number over a tensor is its reciprocal times the number), in the loss's fp32.
    scale = (torch.full_like(tokens, share) / tokens).float() if torch.is_tensor(tokens) else share / tokens
    loss_sum = torch.zeros((), dtype=torch.float32, device=engine.ctx.device)
    for i, m in enumerate(micro):
        b = m.batch.to(engine.ctx.device)
        with dropout_of(m.stream):
            loss, _ = engine.module.loss(b.src, b.tgt_in, b.tgt_out, label_smoothing)
            engine.backward(loss * scale)
        if i == len(micro) - 1:
            engine.note_grad_norm()
        engine.step()
        loss_sum += loss.detach().float()
    return loss_sum


def pipeline_step(
    engine: Engine, pipeline: Pipeline, feed: DataFeed, micro: Sequence[MicroBatch], tokens: float, t
) -> torch.Tensor:
    """One optimizer step through this rank's pipeline stage; the stage's summed loss (0 off the last stage).

    Every backward of the step runs before the one optimizer step (the pipeline's
    transfers must all be done before the step's collectives over the stages), so the
    engine is told which backward is the step's last.
    """
    scale = engine.accumulation * engine.ctx.dp_size / tokens
    seen: dict[int, int] = {}
    batches = []
    for m in micro:
        index = seen.get(m.stream, 0)
        seen[m.stream] = index + 1
        b = m.batch.to(engine.ctx.device)
        batch = StageBatch.of(b.src, b.tgt_in, b.tgt_out, engine.module)
        batches.append(PipeMicroBatch(batch, pipeline.dropout_state(feed.dropout[m.stream], index)))
    done = 0

    def backward(scalar: torch.Tensor, scaled: bool) -> None:
        nonlocal done
        done += 1
        engine.set_boundary(done == len(batches))
        engine.backward(scalar, scale_wrt_gas=scaled)

    loss = pipeline.train_step(batches, scale, t.label_smoothing, backward, engine.loss_scale())
    for stream, count in seen.items():
        pipeline.advance(feed.dropout[stream], count)
    engine.note_grad_norm()
    engine.step()
    pipeline.sync_embedding()
    return loss


@dataclass(frozen=True)
class StepFlags:
    """What a rank says before a step; after the step's all-reduce, what any rank said (every rank acts alike)."""

    usr1: bool = False  # SIGUSR1 received: save, requeue, stop
    term: bool = False  # SIGTERM received: save, stop
    time_up: bool = False  # train.max_minutes spent
    save_due: bool = False  # train.save_minutes passed since the last save
    cooldown: bool = False  # the cool-down's share of train.max_minutes reached

    def as_floats(self) -> list[float]:
        return [float(getattr(self, f.name)) for f in fields(self)]

    @classmethod
    def any_of(cls, summed: list[float]) -> StepFlags:
        """The flags from their world sums: set where any rank set it."""
        return cls(*(value > 0 for value in summed))

    @property
    def signal(self) -> int:
        """The signal said: TERMINATE (TERM or INT wins over USR1), REQUEUE (USR1) or NONE."""
        return TERMINATE if self.term else REQUEUE if self.usr1 else NONE


@dataclass(frozen=True)
class Outcome:
    """A step as every rank sees it after the step's all-reduce: what the loop validates, saves and stops on."""

    step: int
    signal: int = NONE  # any rank's: REQUEUE (SIGUSR1) or TERMINATE (SIGTERM, SIGINT, the launcher gone)
    end: str | None = None  # the run's bound reached at this step: "time limit" or "cool-down"
    save_due: bool = False  # train.save_minutes passed by some rank's clock
    final: bool = False  # the step is train.max_steps
    stopped_by: str = "SIGTERM"  # what a TERMINATE came from, as this rank heard it (the save's reason)

    @property
    def last(self) -> bool:
        """The run's last step, not cut short by a signal: it is validated before its save."""
        return self.signal == NONE and (self.end is not None or self.final)


class Window:
    """Sums over the steps since the last log line."""

    def __init__(self) -> None:
        self.reset()

    waited_from = 0.0  # the pipeline's wait counter at the window's start

    def reset(self) -> None:
        self.loss, self.tokens, self.seconds = 0.0, 0.0, 0.0

    def add(self, loss: float, tokens: float, seconds: float) -> None:
        self.loss += loss
        self.tokens += tokens
        self.seconds += seconds
