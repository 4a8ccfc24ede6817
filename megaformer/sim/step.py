"""One training step of a config, run by the real code on tensors that hold no data, and recorded.

:func:`record_step` builds the model of ``cfg`` (tp=1, one replica) as the Trainer does, on the
``meta`` device for a GPU (the code's non-CPU branches) or under ``FakeTensorMode`` on the CPU,
wraps it in the engine ``megaformer train`` uses on one GPU (:mod:`megaformer.train.lean`: no
DeepSpeed at one replica), and runs the Trainer's own step functions on micro-batches of the
configured size (:func:`megaformer.train.step.accumulate` for the forward, loss and backward of
each micro-batch and the optimizer step, :func:`megaformer.train.step.world_sum` for the
step's reads), recording every aten operator (:class:`megaformer.sim.ops.OpRecorder`).

The micro-batches are ``sentences`` of ``length`` tokens a side (eos and bos included in
the count), as many as ``data.max_tokens`` holds, and as many micro-batches as the step plan
gives for ``train.tokens_per_step`` (:func:`megaformer.data.batching.plan_step`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megaformer.config import Config
from megaformer.data.batching import plan_step
from megaformer.data.stream import Batch
from megaformer.model import Transformer
from megaformer.parallel import DropoutRNG, ParallelContext
from megaformer.sim.ops import FusedAttention, Op, OpRecorder
from megaformer.train.feed import MicroBatch
from megaformer.train.step import accumulate, world_sum


@dataclass(frozen=True)
class MicroShape:
    """One micro-batch: ``sentences`` x ``src_len`` source and ``sentences`` x ``tgt_len`` target tokens."""

    sentences: int
    src_len: int
    tgt_len: int

    @property
    def target_tokens(self) -> int:
        return self.sentences * self.tgt_len


def step_shape(cfg: Config, length: int) -> list[MicroShape]:
    """The micro-batches of a step of ``cfg`` at one replica for sentences of ``length`` tokens a side (eos
    included): as many sentences as ``data.max_tokens`` holds, as many micro-batches as the step plan gives."""
    plan = plan_step(cfg.train.tokens_per_step, 1, cfg.data.max_tokens, min(length, cfg.data.max_tokens))
    sentences = max(1, plan.max_tokens_per_micro_batch // length)
    return [MicroShape(sentences, length, length)] * plan.micro_batches_per_rank(1)


def _batch(shape: MicroShape, vocab: int) -> Batch:
    """A micro-batch of ids on the host, as the feed hands it over (every token real, none padded)."""
    token = min(5, vocab - 1)
    src = torch.full((shape.sentences, shape.src_len), token, dtype=torch.long, device="cpu")
    tgt = torch.full((shape.sentences, shape.tgt_len), token, dtype=torch.long, device="cpu")
    return Batch(src, tgt, tgt.clone(), src.numel(), tgt.numel())


def build_model(cfg: Config, ctx: ParallelContext, rng: DropoutRNG) -> Transformer:
    """The Trainer's model at tp=1 on ``ctx.device`` (the engine casts it to the run's precision)."""
    model = Transformer.of_run(cfg, ctx.tp, rng)
    if next(model.parameters()).device != ctx.device:  # built under FakeTensorMode, it is there already
        model.to(ctx.device)
    return model.train()


@contextlib.contextmanager
def _fused_optimizers_on_meta():
    """torch's fused Adam on meta tensors: the kernel has a meta form, but the optimizer's device check refuses meta."""
    import torch.optim.optimizer as optimizer

    supported = optimizer._get_fused_kernels_supported_devices
    optimizer._get_fused_kernels_supported_devices = lambda: [*supported(), "meta"]
    try:
        yield
    finally:
        optimizer._get_fused_kernels_supported_devices = supported


class _Step:
    """The Trainer's step functions over a model and engine of ``cfg`` on ``device``, for the micro-batches ``shapes``."""

    def __init__(self, cfg: Config, shapes: list[MicroShape], device: str) -> None:
        from megaformer.train.lean import LeanEngine

        self.ctx = ctx = ParallelContext.single(device)
        self.rng = DropoutRNG(cfg.train.seed, ctx.tp, 0, cfg.parallel.dropout_rng)
        self.engine = LeanEngine.create(cfg, ctx, build_model(cfg, ctx, self.rng), len(shapes))
        self.micro = [MicroBatch(0, _batch(m, cfg.data.vocab_size)) for m in shapes]
        self.tokens = float(sum(m.target_tokens for m in shapes))
        self.smoothing = cfg.train.label_smoothing
        self.state = self.rng.state_dict()

    @contextlib.contextmanager
    def dropout_of(self, stream: int):
        with self.rng.fork(self.state):
            yield

    def __call__(self) -> None:
        """One step as ``Trainer.step`` runs it: the token count, the micro-batches, the step's one read."""
        tokens = world_sum(self.ctx, [self.tokens])[0]
        loss = accumulate(self.engine, self.micro, tokens, self.smoothing, self.dropout_of)
        broken = self.engine.not_finite(loss).float()
        world_sum(self.ctx, [self.tokens, 0.0], (loss, broken)).tolist()


def record_step(cfg: Config, shapes: list[MicroShape], device: str, steps: int = 2) -> list[Op]:
    """The operators of one steady training step of ``cfg`` (the last of ``steps``) on ``device``.

    ``device``: "meta" (a GPU's code path) or "cpu" (FakeTensorMode: the CPU's code path).
    """
    meta = device == "meta"
    fake = FakeTensorMode(allow_non_fake_inputs=True) if not meta else contextlib.nullcontext()
    with fake, FusedAttention() if meta else contextlib.nullcontext(), _fused_optimizers_on_meta():
        step = _Step(cfg, shapes, device)
        recorder = OpRecorder(device, signatures=not meta)
        for _ in range(steps):
            recorder.ops.clear()
            with recorder:
                step()
        return recorder.ops


def run_step(cfg: Config, shapes: list[MicroShape], steps: int = 5, warmup: int = 2) -> tuple[float, int]:
    """The quickest of ``steps`` real steps on this CPU (after ``warmup``), in seconds, and the operators of one.

    The quickest, not the median: what this CPU takes when nothing else runs on it (another process on a
    core stalls the step's threads for milliseconds at a time)."""
    step = _Step(cfg, shapes, "cpu")
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    recorder = OpRecorder("cpu")
    with recorder:
        step()
    return min(times), len(recorder.ops)
