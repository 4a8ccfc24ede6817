"""The engine pieces: generated DeepSpeed config, the schedule, gradient accumulation, activation checkpointing."""

import os
from contextlib import contextmanager, nullcontext

import pytest
import torch

from launcher.local import spawn
from megaformer.config import Config, load_config
from megaformer.errors import ConfigError
from megaformer.train.engine import deepspeed_config
from megaformer.train.schedule import (
    Cooldown,
    InverseSqrtSchedule,
    cooldown_start,
    cooldown_time_reached,
    inverse_sqrt_lr,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


def test_schedule_is_the_papers():
    d, warm = 512, 4000
    assert inverse_sqrt_lr(1, d, warm) == pytest.approx(d**-0.5 * 1 * warm**-1.5)
    assert inverse_sqrt_lr(warm, d, warm) == pytest.approx(d**-0.5 * warm**-0.5)  # the peak
    assert inverse_sqrt_lr(4 * warm, d, warm) == pytest.approx(d**-0.5 * (4 * warm) ** -0.5)
    assert InverseSqrtSchedule(d, warm)(0) == inverse_sqrt_lr(1, d, warm)  # LambdaLR index 0 = first update
    assert inverse_sqrt_lr(10, d, warm, lr_scale=2.0) == 2 * inverse_sqrt_lr(10, d, warm)


def test_cooldown_ramps_the_schedule_linearly_to_zero():
    d, warm = 512, 100
    schedule = InverseSqrtSchedule(d, warm)
    schedule.cooldown = Cooldown(start=200, length=4)
    plain = [inverse_sqrt_lr(step, d, warm) for step in range(1, 207)]
    ramped = [schedule(index) for index in range(206)]
    assert ramped[:200] == plain[:200]  # updates 1..200 untouched
    # updates 201..204 get 4/5 .. 1/5 of the paper's lr, and every update after the ramp none
    assert [r / p for r, p in zip(ramped[200:], plain[200:])] == pytest.approx([0.8, 0.6, 0.4, 0.2, 0.0, 0.0])


def test_cooldown_begins_when_either_budget_is_spent_to_its_fraction():
    # a step budget: the last 30 % of 30 steps, decided at update 21, lasting to 30
    assert cooldown_start(0.3, 20, 30, time_reached=False) is None
    assert cooldown_start(0.3, 21, 30, time_reached=False) == Cooldown(21, 9)
    # a time budget: as many updates as the rest of the time gives at the rate so far
    assert cooldown_start(0.2, 4000, 100_000, time_reached=False) is None
    assert cooldown_start(0.2, 4000, 100_000, time_reached=True) == Cooldown(4000, 1000)
    assert cooldown_start(0.5, 4000, 100_000, time_reached=True) == Cooldown(4000, 4000)
    # ... but never past max_steps, and at least one update
    assert cooldown_start(0.5, 4000, 5000, time_reached=True) == Cooldown(4000, 1000)
    assert cooldown_start(0.5, 0, 5000, time_reached=True) == Cooldown(0, 1)
    # ... or, where measured, the updates the rest of the time gives at the recent rate: the same bounds
    assert cooldown_start(0.2, 4000, 100_000, True, expected_left=1300) == Cooldown(4000, 1300)
    assert cooldown_start(0.5, 4000, 5000, True, expected_left=3000) == Cooldown(4000, 1000)
    assert cooldown_start(0.2, 4000, 100_000, True, expected_left=0) == Cooldown(4000, 1)
    assert cooldown_start(0.0, 10**6, 30, time_reached=True) is None  # off
    # the time is each rank's training seconds against (1 - fraction) of train.max_minutes
    assert not cooldown_time_reached(0.2, 47.9 * 60, 60)
    assert cooldown_time_reached(0.2, 48.0 * 60, 60)
    assert not cooldown_time_reached(0.2, 10**9, 0)  # no time budget
    assert not cooldown_time_reached(0.0, 10**9, 60)
    for bad in ("1", "-0.1", "nan"):  # a ramp over the whole run, or none of it, is refused by name
        with pytest.raises(ConfigError, match="train.cooldown_fraction"):
            load_config(TINY, [f"train.cooldown_fraction={bad}"])


def test_deepspeed_config_is_generated_from_ours():
    cfg = load_config(TINY, ["train.zero_stage=2", "train.precision=bf16", "train.clip_grad=1.0"])
    ds = deepspeed_config(cfg, dp=4, accum=3)
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 4
    assert ds["gradient_accumulation_steps"] == 3
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert ds["gradient_clipping"] == 1.0
    # bf16 gradients are reduced and accumulated in fp32; fp32 and fp16 leave DeepSpeed's defaults
    assert ds["communication_data_type"] == "fp32" and ds["data_types"]["grad_accum_dtype"] == "fp32"
    assert "communication_data_type" not in deepspeed_config(load_config(TINY), dp=2, accum=1)
    # contiguous gradient buffers: on by default with CUDA, off on a CPU, or as set
    assert ds["zero_optimization"]["contiguous_gradients"]
    assert not deepspeed_config(cfg, dp=4, accum=3, device_type="cpu")["zero_optimization"]["contiguous_gradients"]
    forced = load_config(TINY, ["train.zero_stage=2", "train.zero_contiguous_gradients=true"])
    assert deepspeed_config(forced, dp=2, accum=1, device_type="cpu")["zero_optimization"]["contiguous_gradients"]
    fp16 = deepspeed_config(load_config(TINY, ["train.zero_stage=1", "train.precision=fp16"]), dp=1, accum=1)
    assert fp16["fp16"]["enabled"] and fp16["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    with pytest.raises(ConfigError, match="zero_stage=1"):
        deepspeed_config(load_config(TINY, ["train.zero_stage=0", "train.precision=bf16"]), dp=1, accum=1)


def _batches(cfg: Config):
    from megaformer.data.stream import Batch
    from megaformer.parity import random_batch

    out = []
    for seed, (n, s, t) in enumerate([(3, 9, 7), (5, 6, 11)]):
        src, tgt_in, tgt_out = random_batch(cfg.data.vocab_size, n, s, t, seed=seed)
        out.append(Batch(src, tgt_in, tgt_out, int(src.ne(0).sum()), int(tgt_out.ne(0).sum())))
    return out


def _double(a, b):
    from megaformer.data.stream import Batch

    def cat(x, y):
        width = max(x.shape[1], y.shape[1])
        pad = lambda z: torch.nn.functional.pad(z, (0, width - z.shape[1]))  # noqa: E731
        return torch.cat([pad(x), pad(y)])

    return Batch(
        cat(a.src, b.src),
        cat(a.tgt_in, b.tgt_in),
        cat(a.tgt_out, b.tgt_out),
        a.src_tokens + b.src_tokens,
        a.tgt_tokens + b.tgt_tokens,
    )


def _checked_norm(engine, model, note_grad_norm):
    def checked() -> None:
        grads = [p.grad.double() for p in model.parameters() if p.grad is not None]
        expected = torch.sqrt(sum(g.pow(2).sum() for g in grads)).item()
        note_grad_norm()
        assert expected > 0 and abs(engine.grad_norm() - expected) <= 1e-6 * expected, (engine.grad_norm(), expected)

    return checked


def _accumulation_worker(zero_stage: int) -> int:
    from megaformer.model import Transformer
    from megaformer.parallel import DropoutRNG, ParallelContext
    from megaformer.train.engine import build_engine
    from megaformer.train.feed import MicroBatch
    from megaformer.train.step import accumulate

    # Adam's eps is raised from 1e-9: with 1e-9 an element whose gradient is ~1e-9 moves by
    # ~lr whatever its sign, so the rounding noise of a different summation order (two
    # micro-batches or one double batch) decides its update. The accumulation is what is
    # tested here; the gradients themselves are compared at eps's default below.
    cfg = load_config(
        TINY,
        [
            "parallel.backend=gloo",
            "model.dropout=0",
            f"train.zero_stage={zero_stage}",
            "train.warmup_steps=4",
            "train.adam_eps=1e-3",
        ],
    )
    ctx = ParallelContext.initialize(cfg.parallel, 0, 1, single_process_group=True)
    micro = _batches(cfg)
    tokens = sum(b.tgt_tokens for b in micro)
    results = []
    for accumulation, batches in ((2, micro), (1, [_double(*micro)])):
        model = Transformer(cfg.model, cfg.data.vocab_size, ctx.tp, DropoutRNG(1, ctx.tp), seed=7)
        engine = build_engine(cfg, ctx, model, accumulation)
        if zero_stage == 0:  # the engine computes the norm itself: check it against one in fp64 over every gradient
            engine.note_grad_norm = _checked_norm(engine, model, engine.note_grad_norm)
        for _ in range(2):  # two optimizer steps, so Adam's moments matter too
            micro_batches = [MicroBatch(0, b) for b in batches]
            accumulate(engine, micro_batches, tokens, cfg.train.label_smoothing, lambda stream: nullcontext())
        results.append({n: p.detach().clone() for n, p in model.named_parameters()})
    worst = max((results[0][n] - results[1][n]).abs().max().item() for n in results[0])
    assert worst <= 1e-6, f"2 x micro-batch vs one double batch: max parameter difference {worst:.3e}"
    moved = max(
        (results[0][n] - p.detach()).abs().max().item()
        for n, p in Transformer(
            cfg.model, cfg.data.vocab_size, ctx.tp, DropoutRNG(1, ctx.tp), seed=7
        ).named_parameters()
    )
    assert moved > 1e-4, "the steps did not change the weights"
    return 0


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_accumulation_equals_double_batch(zero_stage):
    assert spawn(_accumulation_worker, 1, zero_stage) == 0


@contextmanager
def _benchmark_trainer(data: str, run_dir: str, sets: tuple[str, ...]):
    """The in-process Trainer of benchmarks/host_overhead.py (one process, gloo, 2 micro-batches a step), ``sets`` on."""
    import sys
    from pathlib import Path

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from host_overhead import build_trainer

    trainer, ctx = build_trainer(Path(data), Path(run_dir), sets)
    try:
        yield trainer
    finally:
        ctx.destroy()


def _reads_worker(data: str, run_dir: str, sets: tuple[str, ...], expected: int) -> int:
    from megaformer.train.step import StepFlags

    with _benchmark_trainer(data, run_dir, sets) as trainer:
        from host_overhead import DeviceReads  # benchmarks/ is on the path now

        for _ in range(2):
            trainer.step(StepFlags())
        with DeviceReads() as reads:
            trainer.step(StepFlags())
    assert reads.count == expected, f"{reads.count} reads of the device in a steady step of {sets}, not {expected}"
    return 0


@pytest.mark.parametrize(
    "sets, expected",
    [((), 1), (("train.precision=bf16", "train.zero_stage=1"), 2)],
    ids=["fp32-zero0", "bf16-zero1"],
)
def test_a_steady_step_reads_the_device_once(corpus, tmp_path, sets, expected):
    """On a GPU each read of a tensor's value waits for every kernel queued before it. The step read the token
    count and flags, the loss, the gradient norm and the loss again (4 reads, and 2 waiting copies to the device):
    now one all-reduce after the step carries them all. DeepSpeed's bf16 ZeRO-1 optimizer reads once more (its
    check of the gradient norm for inf and NaN; docs/design.md lists the other optimizers')."""
    assert spawn(_reads_worker, 1, str(corpus), str(tmp_path / "run"), sets, expected) == 0


def _nan_gradient_worker(data: str, run_dir: str, sets: tuple[str, ...]) -> int:
    from megaformer.errors import TrainingError
    from megaformer.train.step import StepFlags

    with _benchmark_trainer(data, run_dir, sets) as trainer:
        trainer.step(StepFlags())
        weight = next(trainer.model.parameters())
        weight.register_hook(lambda grad: grad * float("nan"))  # a finite loss, a NaN gradient
        with pytest.raises(TrainingError, match="the loss or the gradient norm is not finite"):
            trainer.step(StepFlags())
    return 0


@pytest.mark.parametrize(
    "sets", [("train.clip_grad=1.0",), ("train.precision=bf16", "train.zero_stage=1")], ids=["fp32-zero0-clip", "bf16"]
)
def test_a_nan_gradient_under_a_finite_loss_stops_the_run(corpus, tmp_path, sets):
    """Without ZeRO but with clipping DeepSpeed computes the gradient norm, clips by it and drops it; the trainer
    computed its own only without clipping, so a NaN gradient under a finite loss went unseen and trained on."""
    assert spawn(_nan_gradient_worker, 1, str(corpus), str(tmp_path / "run"), sets) == 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_accumulated_gradient_equals_double_batch_gradient(dtype):
    """The scaled losses of two micro-batches give the double batch's gradient.

    float64 checks the arithmetic per tensor (1e-10 relative; measured ~2e-15 under the
    default, avx2 and avx512 kernels): every op, the attention softmax included, must stay
    in float64, since an fp32 step rounds an element differently in the vector body and in
    the scalar tail, and the two batchings put rows at different places. fp32 checks the
    update as a whole (1e-6 of the gradient's norm): per-tensor fp32 ratios of small,
    cancelling sums (a bias fed by many tokens) only measure the summation order.
    """
    from megaformer.model import Transformer
    from megaformer.parallel import LOCAL, DropoutRNG

    cfg = load_config(TINY, ["model.dropout=0"])
    micro = _batches(cfg)
    tokens = sum(b.tgt_tokens for b in micro)
    grads = []
    for batches in (micro, [_double(*micro)]):
        model = Transformer(cfg.model, cfg.data.vocab_size, LOCAL, DropoutRNG(1, LOCAL), seed=7).to(dtype)
        for b in batches:
            loss, _ = model.loss(b.src, b.tgt_in, b.tgt_out, 0.1)
            (loss * len(batches) / tokens / len(batches)).backward()  # what accumulate() and DeepSpeed do
        grads.append({n: p.grad for n, p in model.named_parameters()})
    if dtype == torch.float64:
        for n in grads[0]:
            scale = grads[1][n].abs().max().item()
            assert (grads[0][n] - grads[1][n]).abs().max().item() <= 1e-10 * max(scale, 1e-3), n
    else:
        diff = torch.cat([(grads[0][n] - grads[1][n]).flatten() for n in grads[0]]).norm()
        norm = torch.cat([g.flatten() for g in grads[1].values()]).norm()
        assert diff <= 1e-6 * norm, f"accumulated gradient differs by {diff / norm:.2e} of its norm"


def _checkpointing_worker() -> int:
    from megaformer.model import Transformer
    from megaformer.parallel import DropoutRNG, ParallelContext
    from megaformer.parity import random_batch

    cfg = load_config(
        TINY, ["parallel.tp=2", "parallel.backend=gloo", "model.attention_dropout=0.1", "model.activation_dropout=0.1"]
    )
    ctx = ParallelContext.initialize(cfg.parallel, int(os.environ["RANK"]), 2)
    src, tgt_in, tgt_out = random_batch(cfg.data.vocab_size, 4, 12, 10, seed=3)
    grads, reference_state = [], None
    for checkpointing in (False, True):
        cfg.model.activation_checkpointing = checkpointing
        model = Transformer(cfg.model, cfg.data.vocab_size, ctx.tp, DropoutRNG(5, ctx.tp), seed=5)
        loss, n = model.loss(src, tgt_in, tgt_out, 0.1)
        (loss / n).backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        state_after = model.rng.state_dict()
        if checkpointing:  # recomputation replayed the masks and left the streams where the forward did
            assert state_after == reference_state
        reference_state = state_after
    worst = max((grads[0][k] - grads[1][k]).abs().max().item() for k in grads[0])
    assert worst <= 1e-6, f"activation checkpointing changed gradients by {worst:.3e}"
    ctx.destroy()
    return 0


def test_activation_checkpointing_keeps_gradients_under_tp():
    """Recomputation under TP=2 with dropout everywhere gives the gradients of the plain run."""
    assert spawn(_checkpointing_worker, 2) == 0


class FusedAdam(torch.optim.Optimizer):
    """Adam as apex's and DeepSpeed's FusedAdam keep it: the step count in each param group, not per parameter."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.98), eps=1e-9):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            (b1, b2), t = group["betas"], group["step"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (v / (1 - b2**t)).sqrt_().add_(group["eps"])
                p.addcdiv_(m, denom, value=-group["lr"] / (1 - b1**t))


def _adam_run(make, steps: int, resume_at: int | None = None):
    """Parameters after ``steps`` updates; with ``resume_at``, the optimizer is rebuilt there from saved state."""
    from megaformer.train.engine_state import optimizer_step_count, set_optimizer_step_count

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, 3))
    opt = make([p])
    for step in range(steps):
        if step == resume_at:  # what a resume does: a fresh optimizer, moments and the step count set before a step
            moments = {k: opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")}
            count = optimizer_step_count(opt)
            assert count == resume_at
            opt = make([p])
            set_optimizer_step_count(opt, count)
            opt.state[p].update(moments)
        p.grad = torch.sin(p.detach() * (step + 1))
        opt.step()
    return p.detach().clone(), opt


@pytest.mark.parametrize("kind", ["torch-fused", "torch-foreach", "fused-adam-in-groups"])
def test_resume_keeps_adam_step_count(kind):
    """A resume continues bias correction where it stopped, for each way optimizers keep ``step``."""
    from megaformer.train.engine_state import optimizer_step_count

    make = {
        "torch-fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.9, 0.98), eps=1e-9, fused=True),
        "torch-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.9, 0.98), eps=1e-9, foreach=True),
        "fused-adam-in-groups": lambda ps: FusedAdam(ps),
    }[kind]
    reference, _ = _adam_run(make, 6)
    resumed, opt = _adam_run(make, 6, resume_at=3)
    torch.testing.assert_close(resumed, reference, rtol=0, atol=1e-7)
    assert optimizer_step_count(opt) == 6
    for group in opt.param_groups:
        for p in group["params"]:
            step = opt.state[p].get("step")
            if torch.is_tensor(step):  # fused Adam keeps it on the parameter's device
                expected = p.device if group.get("fused") or group.get("capturable") else torch.device("cpu")
                assert step.device == expected and step.dtype == torch.float32
