"""The lean engine (megaformer/train/lean.py) against DeepSpeed's at one replica, on CPU with gloo.

Measured (torch 2.13 on a CPU, DeepSpeed 0.19.8), 20 steps of 2 micro-batches with dropout on: the
losses, fp32 weights and Adam moments are bitwise DeepSpeed's in fp32 (ZeRO-0 with and without
clipping, ZeRO-1 without) and in bf16 (ZeRO-1: DeepSpeed's BF16_Optimizer, with and without
clipping, at tp=1 and tp=2). With clipping in fp32, DeepSpeed's ZeRO-0 and ZeRO-1 round
differently from each other (ZeRO-1 takes the root of its norm's square and multiplies by
``1 / ((norm + 1e-6) / clip)``); the lean engine is ZeRO-0's, and ZeRO-1's curve is within 1e-6
of it, relative (measured 3.2e-7 on the summed losses, 4.4e-6 at most on a weight)."""

from __future__ import annotations

import json
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from train_helpers import TINY, common, losses, ok, train

from launcher.local import spawn
from megaformer.config import load_config
from megaformer.errors import ConfigError

CLIP = "train.clip_grad=0.9"  # the tiny run's gradient norms fall from 2.7 to 0.8 in 20 steps: about half clip


def _config(*sets: str):
    return load_config(TINY, ["parallel.backend=gloo", "train.warmup_steps=4", *sets])


def _batches(vocab: int) -> list[list]:
    """Four steps' two micro-batches each, of unequal lengths and paddings."""
    from megaformer.data.stream import Batch
    from megaformer.parity import random_batch

    steps = []
    for i in range(4):
        pair = []
        for j, (n, s, t) in enumerate([(3, 9, 7), (5, 6, 11)]):
            src, tgt_in, tgt_out = random_batch(vocab, n, s, t, seed=10 * i + j)
            pair.append(Batch(src, tgt_in, tgt_out, int(src.ne(0).sum()), int(tgt_out.ne(0).sum())))
        steps.append(pair)
    return steps


def _engine(cfg, ctx, rng_state: dict | None = None):
    """build_engine over the tiny model from seed 7 (its dropout streams at ``rng_state``, if given)."""
    from megaformer.model import Transformer
    from megaformer.parallel import DropoutRNG
    from megaformer.train.engine import build_engine

    model = Transformer(cfg.model, cfg.data.vocab_size, ctx.tp, DropoutRNG(1, ctx.tp), seed=7)
    if rng_state is not None:
        model.rng.load_state_dict(rng_state)
    engine = build_engine(cfg, ctx, model, 2)
    engine.train()
    return engine


def _train(engine, batches: list[list], steps: range) -> torch.Tensor:
    """Train ``steps`` (indices into the cycle of ``batches``) as the trainer does; the summed losses."""
    from megaformer.train.feed import MicroBatch
    from megaformer.train.step import accumulate

    out = []
    for step in steps:
        micro = batches[step % len(batches)]
        tokens = torch.tensor(float(sum(b.tgt_tokens for b in micro)), dtype=torch.float64, device=engine.ctx.device)
        loss = accumulate(engine, [MicroBatch(0, b) for b in micro], tokens, 0.1, lambda stream: nullcontext())
        out.append(loss)
    return torch.stack(out)


def _same_state(a: dict, b: dict) -> None:
    for kind in a["tensors"]:
        for name, value in a["tensors"][kind].items():
            assert torch.equal(value, b["tensors"][kind][name]), (kind, name)


def _context(tp: int = 1):
    """This rank of ``tp`` gloo ranks, one thread each (machines running tests run many at once)."""
    import os

    from megaformer.parallel import ParallelContext

    torch.set_num_threads(1)
    cfg = _config(f"parallel.tp={tp}", "parallel.backend=gloo")
    return ParallelContext.initialize(cfg.parallel, int(os.environ["RANK"]), tp, single_process_group=True)


def _parity_worker(precision: str, tp: int) -> int:
    ctx = _context(tp)
    batches = _batches(_config().data.vocab_size)
    cases = {  # (the settings, the largest relative loss difference allowed)
        ("fp32", 1): [
            (("train.zero_stage=0", CLIP), 0.0),
            (("train.zero_stage=1",), 0.0),
            (("train.zero_stage=1", CLIP), 1e-6),
        ],
        ("bf16", 1): [(("train.zero_stage=1",), 0.0), (("train.zero_stage=1", CLIP), 0.0)],
        ("bf16", 2): [(("train.zero_stage=1", CLIP), 0.0)],  # the norm: TP shards summed, replicas counted once
    }[precision, tp]
    for sets, tolerance in cases:
        runs = {}
        for optimizer in ("deepspeed", "lean"):
            cfg = _config(f"parallel.tp={tp}", f"train.precision={precision}", f"train.optimizer={optimizer}", *sets)
            engine = _engine(cfg, ctx)
            runs[optimizer] = (engine, _train(engine, batches, range(20)))
        (ds, ds_losses), (lean, lean_losses) = runs["deepspeed"], runs["lean"]
        assert type(lean).__name__ == "LeanEngine" and type(ds).__name__ == "Engine"
        if tolerance == 0:
            assert torch.equal(ds_losses, lean_losses), (sets, (ds_losses - lean_losses).abs().max().item())
            _same_state(ds.state_dict(), lean.state_dict())
        else:
            worst = ((ds_losses - lean_losses).abs() / ds_losses.abs()).max().item()
            assert worst <= tolerance, (sets, worst)
        assert lean.optimizer_steps == ds.optimizer_steps == 20 and lean.lr() == ds.lr()
    ctx.destroy()
    return 0


@pytest.mark.parametrize("precision, tp", [("fp32", 1), ("bf16", 1), ("bf16", 2)], ids=["fp32", "bf16", "bf16-tp2"])
def test_lean_trains_what_deepspeed_trains(precision, tp):
    """Same model, same micro-batches, 2-step accumulation, 20 steps, with and without clipping: see the module."""
    assert spawn(_parity_worker, tp, precision, tp) == 0


def _round_trip_worker(precision: str) -> int:
    ctx = _context()
    sets = [f"train.precision={precision}", f"train.zero_stage={int(precision == 'bf16')}", CLIP]
    lean_cfg, ds_cfg = _config(*sets, "train.optimizer=lean"), _config(*sets, "train.optimizer=deepspeed")
    batches = _batches(lean_cfg.data.vocab_size)
    whole = _engine(lean_cfg, ctx)
    reference = _train(whole, batches, range(15))
    for writer_cfg in (lean_cfg, ds_cfg):
        writer = _engine(writer_cfg, ctx)
        _train(writer, batches, range(10))
        state = writer.state_dict()
        state = {"tensors": state["tensors"], "counters": json.loads(json.dumps(state["counters"]))}  # meta.json's
        rng = writer.module.rng.state_dict()  # the trainer's feed carries the dropout streams
        for reader_cfg in (lean_cfg, ds_cfg):
            reader = _engine(reader_cfg, ctx, rng)  # fresh weights, replaced by the state's
            reader.load_state_dict(state)
            assert reader.lr() == writer.lr() and reader.optimizer_steps == 10
            after = _train(reader, batches, range(10, 15))
            assert torch.equal(after, reference[10:]), (writer_cfg.train.optimizer, reader_cfg.train.optimizer)
            _same_state(reader.state_dict(), whole.state_dict())
    ctx.destroy()
    return 0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_state_of_either_engine_resumes_on_either_bitwise(precision):
    """10 steps, state_dict (counters through JSON), a fresh engine of each kind loads it, 5 more steps: the losses
    and the state equal 15 uninterrupted lean steps exactly (DeepSpeed in fp32 at ZeRO-0, in bf16 at ZeRO-1)."""
    assert spawn(_round_trip_worker, 1, precision) == 0


class _HostReads(TorchDispatchMode):
    """Counts the operators that read a tensor's value back to the host, and every operator run."""

    READS = ("aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.equal")

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.ops.append(name)
        if name in self.READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def _lean(device: str, *sets: str):
    from megaformer.model import Transformer
    from megaformer.parallel import DropoutRNG, ParallelContext
    from megaformer.train.lean import LeanEngine

    cfg = _config("train.optimizer=lean", *sets)
    ctx = ParallelContext.single(device)
    model = Transformer(cfg.model, cfg.data.vocab_size, ctx.tp, DropoutRNG(1, ctx.tp), seed=7).to(device)
    return LeanEngine.create(cfg, ctx, model, 2), _batches(cfg.data.vocab_size)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_lean_step_reads_nothing_back(precision):
    """Backward, the gradient norm, clipping, Adam and the finite check of a step: no read of a tensor's value."""
    engine, batches = _lean("cpu", f"train.precision={precision}", CLIP)
    _train(engine, batches, range(2))  # Adam's state exists from here on
    with _HostReads() as seen:
        loss = _train(engine, batches, range(2, 3))
        engine.not_finite(loss)
    assert seen.reads == [], seen.reads
    fused = "aten._fused_adam_" in seen.ops
    assert fused and "aten._foreach_norm" in seen.ops and "aten._foreach_mul_" in seen.ops, sorted(set(seen.ops))
    if precision == "bf16":  # copies: the first gradients into their sums, the masters into the weights; adds:
        # the second micro-batch's gradients into the sums, and Adam's step counts
        assert seen.ops.count("aten._foreach_copy_") == 2 and seen.ops.count("aten._foreach_add_") == 2


@pytest.mark.parametrize("sets", [(), (CLIP,), ("train.precision=bf16", CLIP)], ids=["fp32", "fp32-clip", "bf16-clip"])
def test_a_nan_gradient_under_a_finite_loss_is_seen(sets):
    """The step's gradient norm (the finite check's) is of the gradients summed over every micro-batch."""
    engine, batches = _lean("cpu", *sets)
    _train(engine, batches, range(1))
    next(engine.module.parameters()).register_hook(lambda grad: grad * float("nan"))
    loss = _train(engine, batches, range(1, 2))
    assert torch.isfinite(loss).all() and bool(engine.not_finite(loss)) and engine.global_steps == 2


class _Devices(TorchDispatchMode):
    """The devices of every tensor an operator returns."""

    def __init__(self) -> None:
        super().__init__()
        self.devices: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor):
                self.devices.add(t.device.type)
        return out


@pytest.mark.parametrize("fused", [False, True], ids=["foreach-adam", "fused-adam"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_lean_engine_steps_a_model_on_the_meta_device(precision, fused, monkeypatch):
    """As the step recorder of megaformer/sim builds it: no data, nothing read, every tensor on the model's device.
    Where fused Adam is told meta is its device (the recorder does), it runs there; elsewhere Adam's foreach form
    runs (whose step counts torch keeps on the CPU)."""
    import torch.optim.optimizer as optimizer

    if fused:
        supported = optimizer._get_fused_kernels_supported_devices()
        monkeypatch.setattr(optimizer, "_get_fused_kernels_supported_devices", lambda: [*supported, "meta"])
    engine, batches = _lean("meta", f"train.precision={precision}", CLIP)
    with _Devices() as seen:
        loss = _train(engine, batches, range(3))
        broken = engine.not_finite(loss)
    assert engine.global_steps == 3 and broken.device.type == "meta"
    assert seen.devices == ({"meta"} if fused else {"meta", "cpu"}), seen.devices
    assert engine.optimizer.param_groups[0]["fused"] == fused


def _fake_context(dp: int = 1, pp: int = 1, device: str = "cuda"):
    return SimpleNamespace(dp_size=dp, pp_size=pp, device=torch.device(device))


def test_train_optimizer_picks_lean_only_where_it_applies():
    from megaformer.train.engine import optimizer_path

    auto, lean = _config(), _config("train.optimizer=lean")
    assert optimizer_path(auto, _fake_context()) == "lean"  # one GPU replica, fp32
    assert optimizer_path(_config("train.precision=bf16", "train.zero_stage=1"), _fake_context()) == "lean"
    assert optimizer_path(auto, _fake_context(device="cpu")) == "deepspeed"  # CPU runs keep DeepSpeed unless asked
    assert optimizer_path(auto, _fake_context(dp=2)) == "deepspeed"
    assert optimizer_path(_config("train.precision=fp16", "train.zero_stage=1"), _fake_context()) == "deepspeed"
    assert optimizer_path(lean, _fake_context(device="cpu")) == "lean"
    assert optimizer_path(_config("train.optimizer=deepspeed"), _fake_context()) == "deepspeed"
    refused = [
        (lean, _fake_context(dp=2), "dp=2"),
        (lean, _fake_context(pp=2), "pp=2"),
        (_config("train.optimizer=lean", "train.precision=fp16", "train.zero_stage=1"), _fake_context(), "fp16"),
    ]
    for cfg, ctx, what in refused:
        with pytest.raises(ConfigError, match=f"train.optimizer=lean .*{what}.*set train.optimizer=auto") as err:
            optimizer_path(cfg, ctx)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="train.optimizer='adam': choose one of auto, deepspeed, lean"):
        _config("train.optimizer=adam")


def test_train_check_refuses_lean_where_it_cannot_run_before_any_process_starts():
    """``train --check`` (check_launch, torch-free) says what the ranks would: the same line."""
    from megaformer.train.launch import check_launch

    with pytest.raises(ConfigError, match="train.optimizer=lean .*dp=2 pp=1 fp32.*set train.optimizer=auto"):
        check_launch(_config("train.optimizer=lean"), 2)


def test_bf16_without_zero_is_refused_only_for_deepspeed():
    """bf16's fp32 masters are DeepSpeed's ZeRO optimizer's, or the lean engine's own."""
    from megaformer.config import check_precision

    check_precision(_config("train.optimizer=lean", "train.precision=bf16", "train.zero_stage=0").train)
    for optimizer in ("auto", "deepspeed"):
        with pytest.raises(ConfigError, match="set train.zero_stage=1"):
            check_precision(_config(f"train.optimizer={optimizer}", "train.precision=bf16", "train.zero_stage=0").train)


def test_megaformer_train_with_the_lean_engine_resumes_exactly_on_either_engine(corpus, tmp_path):
    """A lean run killed after step 13 resumes from step 10 under DeepSpeed (fp32, ZeRO-0): the curve is the
    uninterrupted lean run's, bitwise."""
    sets = common(corpus) + ["train.max_steps=20", "train.optimizer=lean"]
    whole = train(tmp_path / "whole", 1, sets)
    ok(whole)
    assert "dp=1 pp=1 lean optimizer fp32" in whole.stdout, whole.stdout[:2000]
    run = tmp_path / "cut"
    assert train(run, 1, sets, fault="kill:rank=0:step=13").returncode != 0
    resumed = train(run, 1, [*sets[:-1], "train.optimizer=deepspeed"])
    ok(resumed)
    assert "step-00000010 (step 10" in resumed.stdout and "deepspeed zero=0 fp32" in resumed.stdout
    reference, curve = losses(tmp_path / "whole"), losses(run)
    assert sorted(curve) == list(range(1, 21))
    assert all(curve[step]["loss"] == reference[step]["loss"] for step in curve), (curve, reference)
