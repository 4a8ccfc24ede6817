"""The 1F1B pipeline schedule over one optimizer step's micro-batches.

Why our own schedule rather than ``torch.distributed.pipelining``: its schedules
allocate receive buffers from shapes inferred once, while token-count batches change
shape every micro-batch; and its 1F1B passes one output from stage to stage, while the
encoder output must reach every decoder stage (pytorch#127964). DeepSpeed's
``PipelineModule`` likewise fixes tensor shapes. What is ours is small: the order of
forwards and backwards (Megatron's non-interleaved 1F1B: ``p - s - 1`` warm-up
forwards on stage ``s``, then one forward and one backward in turn, then the
remaining backwards), and which tensors travel (:mod:`megaformer.pipeline.stage`).
The transfers are torch's ``batch_isend_irecv``, which runs on gloo and nccl; a send
and the receive it waits for are posted together, as nccl needs.

Three things keep a pipelined run the same run as an unpipelined one:

* **Dropout masks.** Masks are counter-based (:mod:`megaformer.parallel.rng`): each
  micro-batch draws a fixed number of masks per stream, and a stage knows how many the
  stages before it draw, so it starts each micro-batch at the mask the whole model
  would have drawn there.
* **The shared embedding.** The first stage owns the table (the optimizer's copy,
  the checkpoint's); the stage that embeds the target and the last stage (output
  projection) hold a copy. At the end of a step each copy sends the gradient it
  gathered over the step's micro-batches to the owner, which adds it through autograd
  in its last backward (as the surrogate term ``sum(table * grad)``, so that DeepSpeed's
  hooks and loss scaling treat it as any gradient): the optimizer sees the gradient of
  one table used three times (Megatron's embedding group). After the step the owner sends the new table to the copies.
* **One optimizer step everywhere.** Gradient norms and fp16 overflow are reduced over
  the model group (TP x PP) by DeepSpeed, which receives that group from our
  :class:`~megaformer.train.engine.ModelParallelUnit`, so every stage clips by the same
  norm and skips the same steps.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megaformer.model import Transformer
from megaformer.parallel import ParallelContext
from megaformer.parallel.stages import OWN, StagePart
from megaformer.pipeline.stage import StageBatch, input_shapes, mask_draws, stage_forward, stage_outputs


@dataclass
class PipeMicroBatch:
    """A micro-batch as the schedule sees it: its ids and the dropout state it starts from."""

    batch: StageBatch
    dropout: dict[str, list[int]]  # [seed, draws] per stream where the whole model's masks start


Backward = Callable[[torch.Tensor, bool], None]  # (scalar, scaled_by_accumulation)


class Pipeline:
    """This rank's stage of a pipeline: the 1F1B step, forward-only evaluation and the embedding copies."""

    def __init__(self, ctx: ParallelContext, model: Transformer, parts: Sequence[StagePart]) -> None:
        self.ctx, self.model, self.parts = ctx, model, list(parts)
        self.part = self.parts[ctx.pp_rank]
        self.next_part = None if self.part.last else self.parts[self.part.index + 1]
        self.prev_rank = None if self.part.first else ctx.stage_rank(self.part.index - 1)
        self.next_rank = None if self.part.last else ctx.stage_rank(self.part.index + 1)
        self.holders = [ctx.stage_rank(p.index) for p in self.parts if p.embedding]
        self.owner = ctx.stage_rank(0)
        # Masks per micro-batch of every stage, gathered once: where this stage's start.
        mine = mask_draws(model)
        counts = torch.tensor([mine["shared"], mine["local"]], dtype=torch.int64, device=ctx.device)
        every = [torch.zeros_like(counts) for _ in range(ctx.pp_size)]
        dist.all_gather(every, counts, group=ctx.pp_group)
        every = [c.tolist() for c in every]
        self.offset = {
            "shared": sum(c[0] for c in every[: self.part.index]),
            "local": sum(c[1] for c in every[: self.part.index]),
        }
        self.per_micro_batch = {"shared": sum(c[0] for c in every), "local": sum(c[1] for c in every)}
        self.wait_seconds = 0.0  # time spent waiting for neighbours (the bubble, and transfer time)
        self._embed_grad: torch.Tensor | None = None

    # ---- dropout positions ------------------------------------------------------------------

    def dropout_state(self, base: dict[str, list[int]], index: int) -> dict[str, list[int]]:
        """Where micro-batch ``index`` of a stream whose masks were at ``base`` starts, on this stage."""
        return {k: [base[k][0], base[k][1] + index * self.per_micro_batch[k] + self.offset[k]] for k in base}

    def advance(self, base: dict[str, list[int]], micro_batches: int) -> None:
        """Move a stream's state past ``micro_batches`` micro-batches (as the whole model's forwards would)."""
        for k in base:
            base[k][1] += micro_batches * self.per_micro_batch[k]

    # ---- transfers ----------------------------------------------------------------------------

    def _exchange(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> None:
        """Post every send and receive together, then wait for all of them.

        The k-th tensor for one peer travels with tag k: gloo may deliver two messages
        between the same ranks in either order, and the encoder output and the decoder
        states have equal shapes whenever source and target are equally long.
        """
        # gloo sends and receives host memory only: GPU tensors (parallel.device=cuda) are staged through it.
        host = self.ctx.backend == "gloo" and self.ctx.device.type != "cpu"
        wire = [(t.detach().to("cpu") if host else t.contiguous(), peer) for t, peer in sends]
        landing = [(torch.empty(t.shape, dtype=t.dtype) if host else t, peer) for t, peer in recvs]
        ops = [dist.P2POp(dist.isend, t, peer, tag=k) for t, peer, k in _tagged(wire)]
        ops += [dist.P2POp(dist.irecv, t, peer, tag=k) for t, peer, k in _tagged(landing)]
        if not ops:
            return
        began = time.perf_counter()
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        self.wait_seconds += time.perf_counter() - began
        if host:
            for (t, _), (h, _) in zip(recvs, landing, strict=True):
                t.copy_(h)

    def _empty(self, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
        return [torch.empty(s, dtype=self.dtype, device=self.ctx.device) for s in shapes]

    @property
    def host_waits(self) -> bool:
        """Whether :attr:`wait_seconds` measures the bubble: gloo's wait() returns once the transfer is
        done; nccl's only orders this GPU's stream after it, so the host hardly waits in it."""
        return self.ctx.backend == "gloo"

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype: the parameters' (DeepSpeed casts them for bf16 and fp16)."""
        return next(self.model.parameters()).dtype

    # ---- the step -------------------------------------------------------------------------------

    def train_step(
        self, micro: Sequence[PipeMicroBatch], scale: float, smoothing: float, backward: Backward, loss_scale: float
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch in 1F1B order; returns this stage's summed loss (0 off the last).

        ``scale`` multiplies each micro-batch's summed loss (the trainer's token
        normalisation); ``backward(scalar, scaled)`` runs the engine's backward, with
        ``scaled`` False for the surrogate ``sum(output * grad)`` of an inner stage
        (its gradient is already scaled); ``loss_scale`` is the fp16 loss scale the
        engine multiplies every backward scalar by.
        """
        step = _Step(self, micro, scale, smoothing, backward, loss_scale)
        m = len(micro)
        warmup = min(self.ctx.pp_size - self.part.index - 1, m)
        for i in range(warmup):
            out = step.forward(i, step.receive_inputs(i))
            self._exchange([(o.detach(), self.next_rank) for o in out], [])
        inputs = step.receive_inputs(warmup) if warmup < m else []
        for i in range(warmup, m):  # steady state: one forward, one backward
            out = step.forward(i, inputs)
            grads = step.grad_buffers()
            self._exchange([(o.detach(), self.next_rank) for o in out], [(g, self.next_rank) for g in grads])
            sends = step.backward(grads)
            inputs = step.input_buffers(i + 1) if i + 1 < m else []
            self._exchange(sends, [(t, self.prev_rank) for t in inputs])
        while step.pending:  # cool-down: the remaining backwards
            grads = step.grad_buffers()
            self._exchange([], [(g, self.next_rank) for g in grads])
            self._exchange(step.backward(grads), [])
        if self.part.embedding not in (None, OWN):
            self._exchange([(self._embed_grad, self.owner)], [])
        return step.loss_sum

    # ---- forward only ----------------------------------------------------------------------------

    @torch.no_grad()
    def forward_only(self, batch: StageBatch) -> torch.Tensor | None:
        """One batch through the pipeline without gradients; the last stage returns its slice of the logits."""
        inputs = self._empty(input_shapes(self.part, batch, self.model)) if self.prev_rank is not None else []
        self._exchange([], [(t, self.prev_rank) for t in inputs])
        out = stage_outputs(self.model, inputs, batch, self.next_part)
        if self.next_part is None:
            return out
        self._exchange([(o, self.next_rank) for o in out], [])
        return None

    # ---- the shared embedding ----------------------------------------------------------------------

    def _copy_needs_grad(self) -> None:
        if self.part.embedding not in (None, OWN):
            self.model.embed.weight.requires_grad_(True)

    def _gather_copy_grad(self) -> None:
        """A copy's gradient of this micro-batch, summed in fp32 (or fp64) over the step (sent to the owner at its end)."""
        if self.part.embedding in (None, OWN):
            return
        weight = self.model.embed.weight
        if weight.grad is not None:
            grad = weight.grad.to(torch.promote_types(weight.grad.dtype, torch.float32))
            self._embed_grad = grad if self._embed_grad is None else self._embed_grad + grad
            weight.grad = None

    def _copies_grad(self) -> torch.Tensor:
        """The copies' gradients of the whole step, summed: the owner adds them in its last backward."""
        weight = self.model.embed.weight
        parts = [torch.empty(weight.shape, dtype=torch.float32, device=weight.device) for _ in self.holders[1:]]
        self._exchange([], list(zip(parts, self.holders[1:], strict=True)))
        return torch.stack(parts).sum(0)

    def sync_embedding(self) -> None:
        """Send the owner's table to the copies (at start, after a load and after every optimizer step)."""
        if not self.part.embedding or len(self.holders) == 1:
            return
        weight = self.model.embed.weight
        if self.part.embedding == OWN:
            self._exchange([(weight.detach(), r) for r in self.holders[1:]], [])
        else:
            # In the parameters' dtype: DeepSpeed casts parameters for fp16 and bf16, not buffers.
            fresh = torch.empty(weight.shape, dtype=self.dtype, device=weight.device)
            self._exchange([], [(fresh, self.owner)])
            self.model.embed.weight = fresh


def _tagged(transfers: list[tuple[torch.Tensor, int]]) -> list[tuple[torch.Tensor, int, int]]:
    """(tensor, peer, k): k counts the tensors for the same peer before this one."""
    seen: dict[int, int] = {}
    out = []
    for tensor, peer in transfers:
        out.append((tensor, peer, seen.get(peer, 0)))
        seen[peer] = seen.get(peer, 0) + 1
    return out


class _Step:
    """One optimizer step's bookkeeping on a stage: micro-batches in flight, the loss, backwards done."""

    def __init__(
        self,
        pipe: Pipeline,
        micro: Sequence[PipeMicroBatch],
        scale: float,
        smoothing: float,
        backward: Backward,
        loss_scale: float,
    ) -> None:
        self.pipe, self.micro, self.scale, self.smoothing = pipe, micro, scale, smoothing
        self.run_backward, self.loss_scale = backward, loss_scale
        self.pending: deque = deque()  # (inputs, outputs) of forwards whose backward is to come
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=pipe.ctx.device)
        self.done = 0
        pipe._embed_grad = None

    def input_buffers(self, i: int) -> list[torch.Tensor]:
        """Empty tensors for what micro-batch ``i``'s input message holds (none on the first stage)."""
        pipe = self.pipe
        if pipe.prev_rank is None:
            return []
        return pipe._empty(input_shapes(pipe.part, self.micro[i].batch, pipe.model))

    def receive_inputs(self, i: int) -> list[torch.Tensor]:
        tensors = self.input_buffers(i)
        self.pipe._exchange([], [(t, self.pipe.prev_rank) for t in tensors])
        return tensors

    def grad_buffers(self) -> list[torch.Tensor]:
        """Empty tensors for the gradients of the oldest pending forward's outputs (none on the last stage)."""
        return [torch.empty_like(o) for o in self.pending[0][1]] if self.pipe.next_rank is not None else []

    def forward(self, i: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        pipe = self.pipe
        for t in inputs:
            t.requires_grad_(True)
        pipe._copy_needs_grad()
        with pipe.model.rng.fork(self.micro[i].dropout):
            out = stage_forward(pipe.model, inputs, self.micro[i].batch, pipe.next_part, self.smoothing)
        if pipe.next_part is None:
            loss, _ = out
            self.loss_sum = self.loss_sum + loss.detach().float()
            self.pending.append((inputs, [loss * self.scale]))
            return []
        self.pending.append((inputs, out))
        return out

    def backward(self, grads: list[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
        """The oldest pending micro-batch's backward; returns its input gradients, addressed to the stage before."""
        pipe = self.pipe
        inputs, outputs = self.pending.popleft()
        self.done += 1
        if pipe.next_part is None:
            self.run_backward(outputs[0], True)
        else:
            # d/d(o) of sum(o * g) is g: the received gradient enters autograd (and every DeepSpeed
            # hook) unchanged; the engine multiplies by the loss scale, so it is divided out first.
            pairs = list(zip(outputs, grads, strict=True))
            if self.done == len(self.micro) and pipe.part.embedding == OWN:
                pairs.append((pipe.model.embed.weight, pipe._copies_grad()))
            wide = lambda t: t.to(torch.promote_types(t.dtype, torch.float32))  # noqa: E731
            self.run_backward(sum((wide(o) * (wide(g) / self.loss_scale)).sum() for o, g in pairs), False)
        pipe._gather_copy_grad()
        if pipe.prev_rank is None:
            return []
        return [(t.grad if t.grad is not None else torch.zeros_like(t), pipe.prev_rank) for t in inputs]
