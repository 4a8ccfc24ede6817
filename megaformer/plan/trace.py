"""One micro-batch of a layout's rank, run by the real code on tensors that hold no data in a fake world.

:func:`megaformer.sim.deepspeed.fake_world` starts ``torch.distributed`` with torch's ``fake`` backend (every collective a
no-op that touches no data) for a world of N ranks in this one process; a :class:`ParallelContext`
is built in it for the layout as on a cluster (``ParallelContext.initialize`` finds the world
started), and passed explicitly as everywhere. :func:`trace_micro` builds rank 0's model (its TP
shard) on the ``meta`` device (a GPU's code path) or under ``FakeTensorMode`` on the CPU, in the
run's precision (DeepSpeed casts the module to bf16 / fp16), and runs one micro-batch's forward,
loss and backward, recording its operators (:class:`megaformer.sim.ops.OpRecorder`), its
collectives and its live tensor bytes (:mod:`megaformer.plan.record`).

A step is affine in the layer counts (each layer's operators, collectives and activations are the
same), so :func:`trace_layers` traces three shallow models -- (1, 1), (2, 1) and (1, 2) encoder and
decoder layers -- and returns the pieces: what the model has besides its layers (embeddings, output
projection, loss), one encoder layer, one decoder layer. Any depth and any pipeline cut is then a
sum of pieces, without building the model again.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megaformer.config import Config
from megaformer.model import Transformer
from megaformer.parallel import DropoutRNG, ParallelContext
from megaformer.plan.measure import context_groups
from megaformer.plan.record import Collective, CollectiveRecorder, LiveBytes
from megaformer.sim.ops import FusedAttention, Op, OpRecorder
from megaformer.sim.step import MicroShape, _batch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Trace:
    """One micro-batch's forward and backward on one rank: operators, collectives, memory (bytes)."""

    ops: list[Op]
    collectives: list[Collective]
    weights: int  # the model's tensors (parameters and buffers) as built
    params: int  # parameter elements
    peak: int  # the most bytes live beyond the weights during forward and backward
    grads: int  # the gradients left after backward

    @property
    def activations(self) -> int:
        return self.peak - self.grads


def trace_micro(cfg: Config, ctx: ParallelContext, shape: MicroShape, device: str) -> Trace:
    """Rank 0's micro-batch of ``cfg`` at ``ctx``'s TP size (see the module docstring). ``device``: "meta" or "cpu"."""
    meta = device == "meta"
    fake = FakeTensorMode(allow_non_fake_inputs=True) if not meta else contextlib.nullcontext()
    live = LiveBytes()
    with fake, FusedAttention() if meta else contextlib.nullcontext(), live:
        rng = DropoutRNG(cfg.train.seed, ctx.tp, 0, cfg.parallel.dropout_rng)
        with torch.device(device) if meta else contextlib.nullcontext():
            model = Transformer.of_run(cfg, ctx.tp, rng)
        _cast(model, DTYPES[cfg.train.precision])
        model.train()
        batch = _batch(shape, cfg.data.vocab_size).to(device)
        weights, params = live.now, sum(p.numel() for p in model.parameters())
        live.reset_peak()
        ops, collectives = OpRecorder(device, signatures=not meta), CollectiveRecorder(context_groups(ctx))
        with ops, collectives:
            loss, _ = model.loss(batch.src, batch.tgt_in, batch.tgt_out, cfg.train.label_smoothing)
            loss.backward()
        del loss
        grads = live.now - weights
        peak = live.peak - weights
    kept = [op for op in ops.ops if not op.name.startswith(("allreduce", "allgather", "_allgather", "reduce_scatter"))]
    return Trace(kept, collectives.calls, weights, params, peak, grads)


def _cast(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """The module's floating tensors in ``dtype`` (``Module.to`` cannot swap a fake parameter for another)."""
    for t in [*model.parameters(), *model.buffers()]:
        if t.is_floating_point() and t.dtype != dtype:
            t.data = t.data.to(dtype)


def shallow(cfg: Config, encoder: int, decoder: int, tp: int, checkpointing: bool) -> Config:
    """``cfg`` with ``encoder`` + ``decoder`` layers, at ``tp``, activation checkpointing as given."""
    model = dataclasses.replace(
        cfg.model, encoder_layers=encoder, decoder_layers=decoder, activation_checkpointing=checkpointing
    )
    parallel = dataclasses.replace(cfg.parallel, tp=tp, pp=1, dp=0, pp_split="")
    return dataclasses.replace(cfg, model=model, parallel=parallel)


def trace_layers(
    cfg: Config, world: int, tp: int, checkpointing: bool, shape: MicroShape, device: str
) -> tuple[Trace, Trace, Trace]:
    """Traces of the (1, 1), (2, 1) and (1, 2)-layer models of ``cfg`` at ``tp`` in a fake world of ``world``."""
    traces = []
    for encoder, decoder in ((1, 1), (2, 1), (1, 2)):
        small = shallow(cfg, encoder, decoder, tp, checkpointing)
        ctx = ParallelContext.initialize(small.parallel, 0, world)
        try:
            traces.append(trace_micro(small, ctx, shape, device))
        finally:
            ctx.destroy()
    return tuple(traces)
