"""What DeepSpeed's engine adds to a step at one replica, modelled from running it: it cannot run on meta tensors.

DeepSpeed builds its optimizer wrappers on a real accelerator (its bf16 optimizer flattens the
weights, its hooks cast and add every gradient), so the step's simulation cannot run it on the
meta device. Instead :func:`deepspeed_extra` runs both engines, DeepSpeed's and the lean one
(:mod:`megaformer.train.lean`), on this CPU for the same step of the config at its narrowest
width (:func:`megaformer.sim.calibrate.narrowest`: the config's depth, parameter tensors and
micro-batches, tiny kernels), records both, and returns the operators DeepSpeed dispatches
beyond the lean engine's, name by name: their count and host reads as measured, their bytes
those of the narrow run scaled by the full model's parameters over the narrow one's (the
operators DeepSpeed adds are per-parameter casts, sums and norms), and the host time of its
Python beyond them (hooks, per-parameter loops: the two steps' measured difference on one thread,
less what its extra operators cost at the lean step's time per operator). The result is a model:
it says so where it is printed.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time

import torch

from megaformer.config import Config
from megaformer.parallel import DropoutRNG, ParallelContext
from megaformer.sim.calibrate import narrowest
from megaformer.sim.ops import Op, OpRecorder
from megaformer.sim.step import MicroShape, _batch, build_model
from megaformer.train.feed import MicroBatch
from megaformer.train.step import accumulate


def _narrow_run(cfg: Config, ctx: ParallelContext, micro_batches: int, steps: int = 5) -> tuple[list[Op], float, int]:
    """The operators of a steady step of ``cfg``'s engine, its quickest seconds on one thread, the parameter count."""
    from megaformer.train.engine import build_engine

    rng = DropoutRNG(cfg.train.seed, ctx.tp)
    model = build_model(cfg, ctx, rng)
    engine = build_engine(cfg, ctx, model, micro_batches)
    micro = [MicroBatch(0, _batch(MicroShape(2, 4, 4), cfg.data.vocab_size))] * micro_batches
    state = rng.state_dict()

    @contextlib.contextmanager
    def dropout_of(stream: int):
        with rng.fork(state):
            yield

    def step() -> None:
        accumulate(engine, micro, float(micro_batches * 8), cfg.train.label_smoothing, dropout_of)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = []
        for i in range(2 + steps):
            began = time.perf_counter()
            step()
            if i >= 2:
                times.append(time.perf_counter() - began)
    finally:
        torch.set_num_threads(threads)
    recorder = OpRecorder("cpu")
    with recorder:
        step()
    return recorder.ops, min(times), sum(p.numel() for p in model.parameters())


def deepspeed_extra(cfg: Config, micro_batches: int, full_parameters: int) -> list[Op]:
    """DeepSpeed's operators beyond the lean engine's in one step of ``cfg`` (see the module docstring).

    Builds a one-process world in this process: DeepSpeed reads ``LOCAL_RANK`` from the environment, which the
    caller sets (an entry point's business, as every launch variable)."""
    small = narrowest(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp=1, backend="gloo")))
    ctx = ParallelContext.initialize(small.parallel, 0, 1, single_process_group=True)
    try:
        runs = {}
        for optimizer in ("deepspeed", "lean"):
            which = dataclasses.replace(small, train=dataclasses.replace(small.train, optimizer=optimizer))
            runs[optimizer] = _narrow_run(which, ctx, micro_batches)
    finally:
        ctx.destroy()
    (ds_ops, ds_seconds, narrow_parameters), (lean_ops, lean_seconds, _) = runs["deepspeed"], runs["lean"]
    scale = full_parameters / narrow_parameters
    extra = collections.Counter(op.name for op in ds_ops) - collections.Counter(op.name for op in lean_ops)
    model: dict[str, Op] = {}
    for op in ds_ops:
        if op.name in extra and op.name not in model:
            same = [o for o in ds_ops if o.name == op.name]
            nbytes = sum(o.bytes for o in same) / len(same) * scale
            kernels = round(sum(o.kernels for o in same) / len(same))
            model[op.name] = Op(op.name, 0.0, nbytes, kernels, False, False, True, op.dtype, "deepspeed")
    ops = [model[name] for name, count in extra.items() for _ in range(count)]
    # DeepSpeed's Python beyond its operators' dispatch (hooks, per-parameter loops): the measured difference of
    # the two steps less what its extra operators cost at the lean step's time per operator
    python = ds_seconds - lean_seconds - len(ops) * lean_seconds / len(lean_ops)
    ops.append(Op("deepspeed python", 0.0, 0.0, 0, False, False, False, "", "deepspeed", max(0.0, python)))
    reads = sum(o.host_read for o in ds_ops) - sum(o.host_read for o in lean_ops)
    read = Op("_local_scalar_dense", 0.0, 0.0, 0, True, False, True, "", "deepspeed")
    return [o for o in ops if o.name != "_local_scalar_dense"] + [read] * max(0, reads)


def with_deepspeed(ops: list[Op], extra: list[Op]) -> list[Op]:
    """``ops`` of a lean step with DeepSpeed's ``extra`` before the step's last read (its own read comes first)."""
    last = max((i for i, op in enumerate(ops) if op.host_read), default=len(ops))
    return ops[:last] + extra + ops[last:]
