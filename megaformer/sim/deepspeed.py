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
less what its extra operators cost at the lean step's time per operator). At ``dp`` replicas DeepSpeed's step runs as rank 0 of a fake world
of ``dp`` ranks (:func:`fake_world`: torch's ``fake`` backend, every collective a no-op), so that its
data-parallel work is counted (ZeRO's partitions, the flat buckets it reduces); the collectives
themselves are left out, for the caller to price on its links. The result is a model: it says so
where it is printed.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

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


COLLECTIVE_OPS = ("allreduce", "allgather", "_allgather", "reduce_scatter", "_reduce_scatter", "broadcast", "barrier")


@contextlib.contextmanager
def fake_world(world: int) -> Iterator[None]:
    """``torch.distributed`` started on the fake backend, as rank 0 of ``world``; ended on leaving."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a fake world needs a process without torch.distributed started")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _runs(small: Config, micro_batches: int, dp: int) -> dict[str, tuple[list[Op], float, int]]:
    """Both engines' narrow steps: the lean one in a world of one, DeepSpeed's as rank 0 of ``dp`` (fake if > 1)."""
    runs = {}
    for optimizer in ("deepspeed", "lean"):
        size = dp if optimizer == "deepspeed" else 1
        parallel = dataclasses.replace(small.parallel, dp=size, pp=1, pp_split="")
        which = dataclasses.replace(
            small, parallel=parallel, train=dataclasses.replace(small.train, optimizer=optimizer)
        )
        with fake_world(size) if size > 1 else contextlib.nullcontext():
            ctx = ParallelContext.initialize(parallel, 0, size, single_process_group=True)
            try:
                runs[optimizer] = _narrow_run(which, ctx, micro_batches)
            finally:
                ctx.destroy()
    return runs


@dataclass
class DeepSpeedExtra:
    """DeepSpeed's step against the lean engine's: its own operators, and the lean operators it does not run
    (its optimizer over a partition instead of the whole, no gradient accumulation into ``.grad`` at ZeRO-2)."""

    ops: list[Op]
    dropped: dict[str, int]  # operator name -> how many of the lean step's last ones DeepSpeed does not run


def deepspeed_extra(cfg: Config, micro_batches: int, full_parameters: int, dp: int = 1) -> DeepSpeedExtra:
    """DeepSpeed's operators beyond the lean engine's in one step of ``cfg`` at ``dp`` replicas (see the module
    docstring), its collectives left out, and the lean operators it does not run.

    DeepSpeed reads ``LOCAL_RANK`` from the environment, which the caller sets (an entry point's business, as
    every launch variable)."""
    small = narrowest(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp=1, backend="gloo")))
    runs = _runs(small, micro_batches, dp)
    (ds_ops, ds_seconds, narrow_parameters), (lean_ops, lean_seconds, _) = runs["deepspeed"], runs["lean"]
    ds_ops = [op for op in ds_ops if not op.name.startswith(COLLECTIVE_OPS)]
    scale = full_parameters / narrow_parameters

    def key(op: Op) -> tuple:
        return op.name, op.bytes, op.new_bytes, op.kernels, op.dtype

    # the operators the lean step has too (the model's) cancel out exactly; each of DeepSpeed's own keeps its sizes
    extra = collections.Counter(map(key, ds_ops)) - collections.Counter(map(key, lean_ops))
    dropped = collections.Counter(
        k[0] for k in (collections.Counter(map(key, lean_ops)) - collections.Counter(map(key, ds_ops))).elements()
    )
    ops = [
        Op(name, 0.0, nbytes * scale, kernels, False, False, True, dtype, "deepspeed", new_bytes=made * scale)
        for (name, nbytes, made, kernels, dtype), count in extra.items()
        for _ in range(count)
    ]
    # DeepSpeed's Python beyond its operators' dispatch (hooks, per-parameter loops): the measured difference of
    # the two steps less what its extra operators cost at the lean step's time per operator
    python = ds_seconds - lean_seconds - len(ops) * lean_seconds / len(lean_ops)
    ops.append(Op("deepspeed python", 0.0, 0.0, 0, False, False, False, "", "deepspeed", max(0.0, python)))
    reads = sum(o.host_read for o in ds_ops) - sum(o.host_read for o in lean_ops)
    read = Op("_local_scalar_dense", 0.0, 0.0, 0, True, False, True, "", "deepspeed")
    return DeepSpeedExtra([o for o in ops if o.name != "_local_scalar_dense"] + [read] * max(0, reads), dict(dropped))


def with_deepspeed(ops: list[Op], extra: DeepSpeedExtra) -> list[Op]:
    """``ops`` of a lean step less the last of those DeepSpeed does not run, with its own operators before the
    step's last read (its own read comes first)."""
    left = dict(extra.dropped)
    kept = []
    for op in reversed(ops):
        if left.get(op.name, 0) > 0:
            left[op.name] -= 1
            continue
        kept.append(op)
    kept.reverse()
    last = max((i for i, op in enumerate(kept) if op.host_read), default=len(kept))
    return kept[:last] + extra.ops + kept[last:]
