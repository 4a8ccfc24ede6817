"""megaformer's step, validation, decoding and checkpoints with every tensor on ``cuda:0``, on a machine without a GPU.

Run by ``make fake-cuda`` with the CUDA build of torch in ``.venv-cuda`` (no driver needed);
with a CPU-only torch (``make test``'s) the whole file is skipped. Each test runs megaformer's
own functions on tensors that are on a CUDA device in name only (tests/fake_cuda.py) under a
:class:`DeviceAudit`, and fails on the first op that mixes a CPU tensor with a CUDA one (what a
real GPU refuses) or, in the training step, on any op that makes or uses a CPU tensor. A 0-dim
CPU tensor is allowed beside CUDA ones, as torch allows it (a scalar argument of a kernel).

What cannot run without a GPU, and what stands in:

* ``backward()`` of tensors on a CUDA device stops in the C++ autograd engine
  ("hasPrimaryContext expects a valid device index"): the training step's backward runs on the
  ``meta`` device instead, the same code (the loss takes its non-CPU branch there as on a GPU),
  audited the same way; on CUDA ``Tensor.backward`` is stood in by gradients of each
  parameter's shape and dtype (zeros in the step, 0.01 before a checkpoint).
* ``pin_memory`` needs the driver (and is not implemented for fake tensors): the step's
  ``world_sum`` runs with pinning replaced by the tensor itself, and the validation stream is
  made without pinning (its batches are then copied to the device blocking).
* Values are needed by decoding, validation (``.item()``) and checkpoints (``torch.save``):
  those run in :class:`CudaInName`, where FakeTensorMode decides every op's devices and the CPU
  computes the values, so their results must equal the same code's on the CPU. Attention there
  takes torch's math form of ``scaled_dot_product_attention`` (torch picks it for a tensor
  subclass), not the flash or memory-efficient kernel a GPU picks; the devices are the same.
* The engine is the one ``build_engine`` gives one GPU (``train.optimizer=auto``: the lean
  engine, torch's fused Adam over fp32 masters). DeepSpeed's (dp > 1, fp16) is not run: it
  builds on a GPU; ZeRO's partitioned state is not covered.
* Tensor parallelism: the step runs also at TP=2 with sequence parallelism, as rank 0 of torch's
  fake process group (its collectives return at once; the audit refuses a CPU tensor handed to
  one, as nccl does). Decoding, validation and checkpoints run at TP=1; pipelines not at all.
* ``train.compile`` (a GPU run's default): Inductor builds CUDA kernels only with a GPU, and
  Dynamo does not trace under a dispatch mode; only compiled layers that Dynamo runs eagerly
  are covered (``test_compiled_layers_run_eagerly_on_fake_cuda``).
"""

from __future__ import annotations

import dataclasses
import json
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fake_cuda import CudaInName, DeviceAudit, NamedCuda
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError, FakeTensorMode

from megaformer import checkpoint as ckpt
from megaformer.config import Config, ModelConfig, to_dict
from megaformer.data.stream import Batch, TokenBatchStream
from megaformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from megaformer.decode.beam import SearchSettings, beam_search
from megaformer.model import Transformer
from megaformer.parallel import LOCAL, DropoutRNG, ParallelContext, ParallelLayout, TPGroup, gather_full_state
from megaformer.train.engine import build_engine
from megaformer.train.feed import MicroBatch
from megaformer.train.lean import LeanEngine
from megaformer.train.step import StepFlags, accumulate, world_sum
from megaformer.train.validation import Validation

if not torch.backends.cuda.is_built() or torch.version.cuda is None:
    pytest.skip(
        f"torch {torch.__version__} is built without CUDA: `make fake-cuda` runs this file with the CUDA build",
        allow_module_level=True,
    )

# torch.compile imports Inductor, whose torch.utils.mkldnn defines TorchScript methods, which this torch deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
TINY = ModelConfig(d_model=32, d_ff=64, num_heads=4, encoder_layers=2, decoder_layers=2, dropout=0.1, max_positions=64)
VOCAB = 1000  # the corpus fixture's tokenizer
SMOOTHING = 0.1
CUDA = torch.device("cuda", 0)  # a rank's device as the launcher picks it (parallel.groups.pick_device)


def _config(corpus: Path | None = None) -> Config:
    cfg = Config()
    cfg.model = TINY
    cfg.train.label_smoothing = SMOOTHING
    cfg.decode.max_len_a, cfg.decode.max_len_b = 0.0, 6  # short searches: a random model never says eos
    if corpus is not None:
        manifest = json.loads((corpus / "manifest.json").read_text())
        cfg.data.path, cfg.data.vocab_size = str(corpus), int(manifest["tokenizer"]["vocab_size"])
    else:
        cfg.data.vocab_size = VOCAB
    return cfg


def _model(seed: int = 1) -> Transformer:
    return Transformer(TINY, VOCAB, LOCAL, DropoutRNG(seed, LOCAL), seed=seed)


@contextmanager
def _on_named_cuda(audit: DeviceAudit):
    """Tensors made on or copied to ``cuda`` are NamedCuda; every op audited, its tensors as the code made them."""
    with CudaInName(), audit:
        yield


def _to_host(tree):
    """Every NamedCuda in ``tree`` as its CPU values (for comparing results outside the modes)."""
    return torch.utils._pytree.tree_map_only(NamedCuda, lambda t: t.host_values, tree)


# ---- the training step -----------------------------------------------------------------------------


def _step_config(device: torch.device) -> Config:
    """bf16 with clipping; the engine ``train.optimizer=auto`` gives one replica on a GPU (the lean one), named on
    the meta device (where auto would take DeepSpeed's)."""
    cfg = _config()
    cfg.train.precision, cfg.train.clip_grad = "bf16", 1.0
    cfg.train.optimizer = "auto" if device.type == "cuda" else "lean"
    return cfg


def _stand_in_backward(model: torch.nn.Module, value: float = 0.0):
    """``Tensor.backward`` where the autograd engine cannot run (a CUDA device it cannot reach): every parameter
    gets a gradient of ``value``, of its shape, dtype and device, as autograd would give it."""

    def backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.full_like(p, value)

    return backward


def _micro_batches() -> list[MicroBatch]:
    """Two padded micro-batches of different shapes from two data streams, made on the host as the loader makes them."""
    out = []
    for stream, (rows, src_len, tgt_len) in enumerate([(3, 7, 6), (2, 5, 9)]):
        src = [[4 + (r * 7 + i) % (VOCAB - 4) for i in range(src_len - 1 - r)] + [EOS_ID] for r in range(rows)]
        tgt = [[4 + (r * 5 + i) % (VOCAB - 4) for i in range(tgt_len - 1 - r)] for r in range(rows)]

        def pad(rows_, width):
            return torch.tensor([row + [PAD_ID] * (width - len(row)) for row in rows_], dtype=torch.long)

        tgt_in = pad([[BOS_ID] + t for t in tgt], tgt_len)
        tgt_out = pad([t + [EOS_ID] for t in tgt], tgt_len)
        tokens = sum(map(len, src)), sum(len(t) + 1 for t in tgt)
        out.append(MicroBatch(stream, Batch(pad(src, src_len), tgt_in, tgt_out, *tokens, torch.arange(rows))))
    return out


@pytest.fixture(params=[1, 2], ids=["tp1", "tp2-sequence-parallel"])
def tp(request) -> TPGroup:
    """LOCAL, or rank 0 of a TP group of 2 (with sequence parallelism) whose collectives go nowhere: torch's fake
    process group, which accepts any tensor; the audit refuses a CPU tensor in a collective, as nccl does."""
    if request.param == 1:
        yield LOCAL
        return
    with _fake_process_group(2) as group:
        yield TPGroup(group, 2, 0)


@contextmanager
def _fake_process_group(size: int):
    """Rank 0 of ``size`` in torch's fake process group: every collective returns at once, its tensors untouched."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _train_step(device: torch.device, tp: TPGroup, monkeypatch) -> tuple[LeanEngine, torch.Tensor, DeviceAudit]:
    """Trainer.step without its last read of the device: the model built on the device, the engine ``build_engine``
    gives it (bf16 weights, fp32 masters), the world's tokens, ``accumulate`` (forward, loss, backward, the update),
    the finiteness check, the step's world_sum. Only the host's values of world_sum (tokens, flags) may be on the
    CPU (their own audit). The model is built on the device (the trainer builds it on the CPU and moves it with
    ``.to``, which fake modules refuse: their parameters cannot be swapped)."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, device=None: self)  # see the module docstring
    cfg = _step_config(device)
    with torch.device(device):
        model = Transformer(TINY, VOCAB, tp, DropoutRNG(1, tp), seed=1, sequence_parallel=tp.size > 1).train()
    if device.type == "cuda":  # fake CUDA: the autograd engine cannot run (see the module docstring)
        monkeypatch.setattr(torch.Tensor, "backward", _stand_in_backward(model))
    ctx = dataclasses.replace(ParallelContext.single(device), layout=ParallelLayout(tp.size, tp.size, 1), tp=tp)
    micro = _micro_batches()
    engine = build_engine(cfg, ctx, model, len(micro))
    assert isinstance(engine, LeanEngine)
    states = {m.stream: DropoutRNG.initial_state(1, tp.rank, m.stream) for m in micro}
    local = float(sum(m.batch.tgt_tokens for m in micro))
    with DeviceAudit(host_allowed=True):
        tokens = world_sum(ctx, [local])[0]
    audit = DeviceAudit()
    with audit:
        loss = accumulate(engine, micro, tokens, SMOOTHING, lambda s: model.rng.fork(states[s]))
        broken = engine.not_finite(loss).float()
    with DeviceAudit(host_allowed=True):
        reduced = world_sum(ctx, [local, 0.0, *StepFlags().as_floats()], (loss, broken))
    assert reduced.device.type == device.type and reduced.shape == (9,)
    return engine, loss, audit


def test_training_step_on_fake_cuda(tp, monkeypatch):
    """Forward and loss (the vocab-parallel cross-entropy, label smoothing, dropout) of two micro-batches through
    ``accumulate`` and the lean engine's update (gradient sums, norm, clipping, torch's fused Adam on the fp32
    masters, the bf16 weights copied back), all on fake CUDA tensors: nothing on the host. The gradients are
    zeros (see the module docstring)."""
    with FakeTensorMode():
        engine, loss, audit = _train_step(CUDA, tp, monkeypatch)
        assert loss.device == CUDA and loss.dtype == torch.float32
        assert engine.last_grad_norm.device == CUDA
        assert all(p.device == CUDA and p.dtype == torch.bfloat16 for p in engine.module.parameters())
        assert all(m.device == CUDA and m.dtype == torch.float32 for m in engine.masters)
        state = engine.optimizer.state[engine.masters[0]]
        assert engine.optimizer.defaults["fused"] and {t.device for t in state.values()} == {CUDA}
    assert engine.global_steps == 1
    assert audit.counts["to device"] == 8, audit.counts  # the two batches' src, tgt_in, tgt_out, ids
    assert audit.counts["device"] > 500 and (audit.counts["collective"] > 0) == (tp.size > 1), audit.counts


def test_training_backward_on_meta(tp, monkeypatch):
    """The same step on the ``meta`` device with autograd's backward (which fake CUDA tensors cannot run): every
    op of forward, backward and the update stays off the host, and every weight gets a gradient. torch's fused
    Adam refuses meta tensors: the lean engine steps Adam's foreach form there."""
    summed = []
    update = LeanEngine._update

    def keep(self):
        summed.append(list(self._summed))
        update(self)

    monkeypatch.setattr(LeanEngine, "_update", keep)
    meta = torch.device("meta")
    engine, loss, audit = _train_step(meta, tp, monkeypatch)
    assert loss.device == meta and engine.global_steps == 1
    assert len(summed) == 1 and all(summed[0]) and len(summed[0]) == len(list(engine.module.parameters()))
    assert all(s.device == meta and s.dtype == torch.float32 for s in engine.sums)
    assert audit.counts["to device"] == 8 and (audit.counts["collective"] > 0) == (tp.size > 1), audit.counts


def test_compiled_layers_run_eagerly_on_fake_cuda(monkeypatch):
    """``train.compile``'s layers (a GPU run's default) when Dynamo runs their frames eagerly: TORCHDYNAMO_DISABLE=1,
    a frame past its recompile limit. The layers then get their dropout keys as 0-dim device tensors (what a traced
    graph reads) in eager code. The traced graphs themselves are not covered: Inductor builds CUDA kernels only
    with a GPU, and Dynamo does not trace under a dispatch mode (it runs the frame eagerly, as here)."""
    monkeypatch.setattr(torch._dynamo.config, "disable", True)
    with FakeTensorMode():
        with torch.device(CUDA):
            model = _model().train()
        model.compile_layers()
        batch = _micro_batches()[0].batch.to(CUDA)
        with DeviceAudit():
            loss, _ = model.loss(batch.src, batch.tgt_in, batch.tgt_out, SMOOTHING)
        assert loss.device == CUDA


def test_the_audit_goes_red():
    """The harness itself: a CPU tensor made in the step, or one mixed with CUDA tensors, fails, naming the op."""
    here = r" at tests/test_fake_cuda\.py:\d+ in test_the_audit_goes_red: "
    with FakeTensorMode():
        x, on_host = torch.ones(4, device=CUDA), torch.arange(4)
        made = r"aten\.arange\.default makes or uses a CPU tensor in the step" + here + r"cpu\(4,\)"
        with pytest.raises(AssertionError, match=made):
            with DeviceAudit():
                torch.arange(4)
        with pytest.raises(AssertionError, match=r"aten\.add\.Tensor mixes a CPU tensor with a device one" + here):
            with DeviceAudit(host_allowed=True):
                x + on_host
        with pytest.raises(AssertionError, match=r"aten\._to_copy\.default copies to the host in the step"):
            with DeviceAudit():
                x.cpu()
        with DeviceAudit():
            x * torch.tensor(2.0)  # a 0-dim CPU tensor is a scalar argument: allowed, as torch allows it
        with pytest.raises(FakeTensorDeviceMismatchError):  # what a real GPU refuses, torch's fake tensors refuse
            x + on_host
    with pytest.raises(FakeTensorDeviceMismatchError), CudaInName():
        torch.ones(4, device="cuda") + torch.arange(4)
    with _fake_process_group(2), DeviceAudit(host_allowed=True):
        with pytest.raises(AssertionError, match=r"c10d\.allreduce_\.default hands a CPU tensor to a collective"):
            dist.all_reduce(torch.ones(2))


# ---- validation, decoding, checkpoints (values needed) -------------------------------------------


def test_validation_on_named_cuda(corpus):
    """``Validation.run``: the loss and NLL over the valid split (batches copied to the device, sums read back) and
    greedy BLEU on a sample (``sample_bleu`` -> ``translate_ids`` -> greedy search); the same numbers as on the CPU."""
    cfg = _config(corpus)
    cfg.train.eval_interval, cfg.train.eval_bleu_sentences = 1, 4

    def stream(index: int, count: int, split: str = "train") -> TokenBatchStream:
        # as Trainer._stream makes it, but without pinning (see the module docstring)
        return TokenBatchStream.from_config(
            cfg.data, split, dp_rank=index, dp_size=count, shuffle=False, repeat=False, max_tokens=0
        )

    def validate(device: str) -> dict:
        model = Transformer(TINY, cfg.data.vocab_size, LOCAL, DropoutRNG(1, LOCAL), seed=3).to(device)
        return Validation(cfg, ParallelContext.single(device), model, None, stream, True, lambda _: None).run()

    on_cpu = validate("cpu")
    audit = DeviceAudit(host_allowed=True)
    with _on_named_cuda(audit):
        on_cuda = validate("cuda")
    assert on_cuda.keys() == on_cpu.keys() and on_cuda["tokens"] == on_cpu["tokens"] > 0
    assert on_cuda["bleu"] == on_cpu["bleu"]
    for key in ("loss", "nll", "ppl"):  # the loss's GPU form sums in one pass, the CPU form in blocks
        assert on_cuda[key] == pytest.approx(on_cpu[key], rel=1e-5)
    assert audit.counts["to device"] and audit.counts["to host"] and audit.counts["device"]


def test_beam_search_on_named_cuda():
    """``beam_search`` of three sentences of different lengths (they finish at different steps: the batch shrinks,
    the cache is reordered), beam 3; the same hypotheses as on the CPU."""
    model = _model(seed=5).eval()
    src = torch.tensor([[5, 6, 7, EOS_ID, PAD_ID, PAD_ID], [8, 9, 10, 11, 12, EOS_ID], [13, EOS_ID] + [PAD_ID] * 4])
    settings = SearchSettings(beam=3, max_len_a=1.0, max_len_b=1)
    on_cpu = beam_search(model, src, settings)
    audit = DeviceAudit(host_allowed=True)
    with _on_named_cuda(audit):
        on_cuda = beam_search(model.to("cuda"), src.to("cuda"), settings)
    assert [h.tokens for h in on_cuda] == [h.tokens for h in on_cpu]
    assert [h.score for h in on_cuda] == pytest.approx([h.score for h in on_cpu], rel=1e-5)
    assert audit.counts["to host"] and audit.counts["device"]


def test_translate_a_checkpoint_on_named_cuda(corpus, tmp_path, monkeypatch, run):
    """``megaformer translate`` in this process from a consolidated model file written on the CPU: the file is read
    on the host, the model built there and moved to ``cuda`` (``run_translation`` takes the GPU when torch sees
    one: ``torch.cuda.is_available`` says so here), the lines tokenized, searched on the device, written back.
    The translations equal the CPU's."""
    cfg = _config(corpus)
    model = Transformer(TINY, cfg.data.vocab_size, LOCAL, DropoutRNG(1, LOCAL), seed=7)
    state = gather_full_state(model, LOCAL)
    tokenizer = (corpus / "spm.model").read_bytes()
    path = tmp_path / "model.pt"
    ckpt.save_consolidated(path, ckpt.Consolidated(cfg, state, cfg.data.vocab_size, tokenizer))
    lines = (corpus / "valid.xx").read_text().splitlines()[:2]
    (tmp_path / "in.txt").write_text("\n".join([lines[0], "", lines[1]]) + "\n")

    def translate(out: str) -> str:
        inputs = ["--ckpt", path, "--input", tmp_path / "in.txt", "--output", tmp_path / out]
        code, _, err = run("translate", *inputs, "--beam", 2, "--quiet")
        assert code == 0, err
        return (tmp_path / out).read_text()

    on_cpu = translate("cpu.txt")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    audit = DeviceAudit(host_allowed=True)
    with _on_named_cuda(audit):
        on_cuda = translate("cuda.txt")
    assert on_cuda == on_cpu and len(on_cuda.splitlines()) == 3
    assert audit.counts["to device"] and audit.counts["device"]


def test_checkpoint_save_and_load_on_named_cuda(tmp_path, monkeypatch):
    """The engine a one-GPU run trains with (``build_engine``: the lean one, bf16 weights, fp32 masters, fused Adam)
    takes two steps on the device, then its checkpoint (``state_dict``: masters and moments copied to the host) is
    written by ``save_checkpoint``, read by ``load_checkpoint`` and put back on the device by ``load_state_dict``
    into another model's engine: the same weights, moments, step count and lr."""
    cfg = _step_config(CUDA)
    ctx = ParallelContext.single("cuda")
    batch = _micro_batches()[0].batch

    def engine_on_device(seed: int) -> LeanEngine:
        model = Transformer(TINY, VOCAB, LOCAL, DropoutRNG(seed, LOCAL), seed=seed).to(ctx.device)
        return build_engine(cfg, ctx, model, 1)

    audit = DeviceAudit(host_allowed=True)
    with _on_named_cuda(audit):
        saved = engine_on_device(seed=1)
        monkeypatch.setattr(torch.Tensor, "backward", _stand_in_backward(saved.module, 0.01))  # see the docstring
        b = batch.to(ctx.device)
        for _ in range(2):
            loss, _ = saved.module.loss(b.src, b.tgt_in, b.tgt_out, SMOOTHING)
            saved.backward(loss)
            saved.note_grad_norm()
            saved.step()
        state = saved.state_dict()
        step_dir = ckpt.save_checkpoint(
            tmp_path / "checkpoints",
            saved.global_steps,
            ctx,
            ckpt.CheckpointState(
                shard=state["tensors"],
                run={"engine": state["counters"], "trainer": {"tokens": 0}},
                replica={"feed": {}},
                rank={"torch_rng": torch.get_rng_state()},
            ),
            meta={"vocab_size": VOCAB, "config": to_dict(cfg)},
            keep_last=2,
        )
        loaded = engine_on_device(seed=2)
        read = ckpt.load_checkpoint(step_dir, ctx, loaded.module)
        loaded.load_state_dict({"tensors": read.shard, "counters": read.run["engine"]})
        assert all(isinstance(t, NamedCuda) for t in [*loaded.module.parameters(), *loaded.masters])
        states = [loaded.optimizer.state[m] for m in loaded.masters]
        assert all(s["step"].device.type == "cuda" and s["exp_avg"].device.type == "cuda" for s in states)
        ours, theirs = saved.state_dict(), loaded.state_dict()
        weights = [_to_host(list(e.module.parameters())) for e in (saved, loaded)]
    assert theirs["counters"] == ours["counters"] and ours["counters"]["optimizer_steps"] == 2
    for key, tensors in ours["tensors"].items():
        assert all(torch.equal(t, theirs["tensors"][key][name]) for name, t in tensors.items()), key
    assert any(t.abs().sum() > 0 for t in ours["tensors"]["exp_avg"].values())  # the moments are not all zero
    assert all(torch.equal(a, b) and a.dtype == torch.bfloat16 for a, b in zip(*weights, strict=True))
    assert loaded.lr() == saved.lr() > 0
    assert audit.counts["to host"] and audit.counts["to device"]
