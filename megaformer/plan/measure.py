"""A layout's step measured on this CPU over gloo: what :mod:`megaformer.plan` predicts, as it really runs.

:func:`measure_worker` is one rank of a real run (launched by ``launcher/local.py::spawn``): it builds
the rank's model, engine (DeepSpeed, as ``megaformer train`` uses on a CPU) and pipeline stage as the
Trainer does, runs steps of fixed micro-batches through the Trainer's own step functions and writes:

* ``memory``: the peak of live tensor storage bytes (:class:`megaformer.plan.record.LiveBytes`, counting
  from before the model is built) during the third step, and the bytes live as it began;
* ``collectives``: every collective of one steady step, by operator and group (count and bytes);
* ``step_s``: the quickest of the timed steps, recorders off.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from megaformer.config import load_config
from megaformer.model import Transformer
from megaformer.parallel import DropoutRNG, ParallelContext
from megaformer.parallel.stages import plan_stages
from megaformer.plan.record import CollectiveRecorder, LiveBytes
from megaformer.sim.step import MicroShape, _batch
from megaformer.train.feed import MicroBatch


def context_groups(ctx: ParallelContext) -> dict:
    """The context's groups by the names the plan gives them."""
    import torch.distributed as dist

    return {
        "tp": ctx.tp.group,
        "dp": ctx.dp_group,
        "pp": ctx.pp_group,
        "model": ctx.model_group if ctx.pp_size > 1 else None,
        "world": dist.group.WORLD,
    }


class _RankStep:
    """The Trainer's step of one rank, on fixed micro-batches."""

    def __init__(self, cfg, ctx: ParallelContext, shapes: list[MicroShape]) -> None:
        from megaformer.pipeline.schedule import Pipeline
        from megaformer.train.engine import build_engine

        t = cfg.train
        self.cfg, self.ctx = cfg, ctx
        self.rng = DropoutRNG(t.seed, ctx.tp, ctx.dp_rank, cfg.parallel.dropout_rng)
        stages = plan_stages(cfg.model, ctx.pp_size, cfg.parallel.pp_split, cfg.data.vocab_size)
        model = Transformer.of_run(cfg, ctx.tp, self.rng, stages[ctx.pp_rank]).to(ctx.device)
        self.engine = build_engine(cfg, ctx, model, len(shapes))
        self.pipeline = Pipeline(ctx, model, stages) if ctx.pp_size > 1 else None
        if self.pipeline is not None:
            self.pipeline.sync_embedding()
        self.micro = [MicroBatch(0, _batch(m, cfg.data.vocab_size)) for m in shapes]
        self.tokens = float(sum(m.target_tokens for m in shapes)) * ctx.dp_size
        self.feed = SimpleNamespace(dropout={0: DropoutRNG.initial_state(t.seed, ctx.tp.rank, 0)})
        self.state = self.rng.state_dict()

    @contextlib.contextmanager
    def dropout_of(self, stream: int):
        with self.rng.fork(self.state):
            yield

    def __call__(self) -> None:
        from megaformer.train.step import accumulate, pipeline_step, world_sum

        ctx, t = self.ctx, self.cfg.train
        if self.pipeline is None:
            tokens = world_sum(ctx, [self.tokens / ctx.dp_size])[0]
            loss = accumulate(self.engine, self.micro, tokens, t.label_smoothing, self.dropout_of)
        else:
            loss = pipeline_step(self.engine, self.pipeline, self.feed, self.micro, self.tokens, t)
        world_sum(ctx, [self.tokens, 0.0], (loss, self.engine.not_finite(loss).float())).tolist()


def measure_worker(config: str, sets: list[str], world: int, shapes: list[MicroShape], steps: int, out: str) -> int:
    """One rank of the measured run; writes ``out/rank-N.json`` (see the module docstring)."""
    cfg = load_config(config, [*sets, "parallel.backend=gloo", "parallel.device=cpu"])
    rank = int(os.environ["RANK"])
    live = LiveBytes()
    with live:
        ctx = ParallelContext.initialize(cfg.parallel, rank, world)
        step = _RankStep(cfg, ctx, shapes)
        for _ in range(2):
            step()
        began = live.now
        live.reset_peak()
        step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    recorder = CollectiveRecorder(context_groups(ctx))
    with recorder:
        step()
    result = {
        "rank": rank,
        "memory": {"peak": live.peak, "before_step": began},
        "collectives": recorder.summary(),
        "step_s": min(times),
        "step_times": times,
    }
    Path(out, f"rank-{rank}.json").write_text(json.dumps(result))
    ctx.destroy()
    return 0


def measure(config: str, sets: list[str], world: int, shapes: list[MicroShape], steps: int, out: Path) -> list[dict]:
    """Every rank's :func:`measure_worker` result for a run of ``world`` local processes."""
    from launcher.local import spawn

    out.mkdir(parents=True, exist_ok=True)
    code = spawn(measure_worker, world, config, list(sets), world, list(shapes), steps, str(out))
    if code:
        raise RuntimeError(f"the measured run of {config} {sets} ended with status {code}")
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


def link_worker(sizes: list[int], out: str) -> int:
    """This host's gloo link: the quickest of 5 all-reduces of each of ``sizes`` bytes (fp32) between the ranks,
    and of 5 all-gathers of a shard of that many bytes from each rank (``link.json``: op -> size -> seconds)."""
    import torch.distributed as dist

    from megaformer.config import ParallelConfig

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ctx = ParallelContext.initialize(ParallelConfig(backend="gloo", device="cpu"), rank, world)
    seconds: dict[str, dict[int, float]] = {"all_reduce": {}, "all_gather": {}}
    for size in sizes:
        x = torch.zeros(max(1, size // 4))
        gathered = torch.empty(world * x.numel())
        for op, call, args in (
            ("all_reduce", dist.all_reduce, (x,)),
            ("all_gather", dist.all_gather_into_tensor, (gathered, x)),
        ):
            times = []
            for _ in range(6):
                dist.barrier()
                started = time.perf_counter()
                call(*args)
                times.append(time.perf_counter() - started)
            seconds[op][size] = min(times[1:])
    if rank == 0:
        Path(out, "link.json").write_text(json.dumps(seconds))
    ctx.destroy()
    return 0
