"""train.compile: compiled layers compute what the eager ones do, with the same dropout masks.

In process: a compiled model against an eager copy of itself (loss, every gradient, the
dropout streams), with and without activation checkpointing, over batches of two
lengths (one dynamic-shape compilation). End to end: a compiled run at TP=2, killed and
resumed, follows the eager run at TP=1 and repeats the killed attempt's steps exactly, and
its checkpoint decodes; a compiled pipeline (pp=2) follows the eager run too.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from train_helpers import common, losses, megaformer, ok, train, train_records

from megaformer.config import ModelConfig
from megaformer.decode.beam import SearchSettings, beam_search
from megaformer.model import Transformer
from megaformer.parallel import LOCAL, DropoutRNG

VOCAB = 97


def _models(activation_checkpointing: bool) -> tuple[Transformer, Transformer]:
    cfg = ModelConfig(
        d_model=32,
        d_ff=64,
        num_heads=4,
        encoder_layers=2,
        decoder_layers=2,
        dropout=0.2,
        attention_dropout=0.1,
        activation_dropout=0.1,
        activation_checkpointing=activation_checkpointing,
        max_positions=64,
    )
    eager = Transformer(cfg, VOCAB, LOCAL, DropoutRNG(5, LOCAL), seed=5)
    compiled = copy.deepcopy(eager)  # the same weights and the same dropout streams
    compiled.compile_layers()
    return eager, compiled


def _batch(
    generator: torch.Generator, batch: int, length: int, target: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sources of ``length`` tokens, targets of ``target`` (``length + 2`` unless given)."""
    src = torch.randint(4, VOCAB, (batch, length), generator=generator)
    src[0, length - 2 :] = 0  # some padding, so the source mask matters
    target = length + 2 if target is None else target
    tgt = torch.randint(4, VOCAB, (batch, target + 1), generator=generator)
    return src, tgt[:, :-1], tgt[:, 1:]


def test_compiled_masks_are_the_eager_masks():
    """The mask computed inside a graph (fused into its consumer) equals the eager one, for any shape."""
    rng = DropoutRNG(3, LOCAL)

    def dropped(x: torch.Tensor) -> torch.Tensor:
        return rng.dropout(x, 0.3, training=True) + 1.0

    compiled = torch.compile(dropped, dynamic=True)
    for shape in ((3, 10), (2, 7, 33), (4, 5, 33)):
        x = torch.randn(shape)
        start = rng.state_dict()
        eager = dropped(x)
        with rng.fork(start):
            assert torch.equal(compiled(x), eager), shape


@pytest.mark.parametrize("activation_checkpointing", [False, True])
def test_compiled_layers_equal_eager_layers_with_dropout_on(activation_checkpointing):
    """The compiled layers' loss and gradients are the eager ones to fp32 rounding, the same masks drawn.

    An element's absolute tolerance is 1e-6 of its tensor's largest value (at least 1e-6):
    Inductor's loops sum in another order than ATen's kernels, and without vector kernels
    (``ATEN_CPU_CAPABILITY=default``) the two differ by up to ~3e-7 of a gradient's scale,
    which an element near zero (a cancelling sum) cannot meet relatively.

    AOTAutograd's cache takes the layers' graphs, their autograd Functions included
    (megaformer.cli), so a restarted process loads them instead of tracing them again; the
    resumed compiled run below is such a process, and must match bitwise.

    The first batch has as many sentences as tokens a side: graphs compiled from it hold for
    the second batch too, whose sizes all differ (Dynamo gives equal sizes one symbol unless
    the layers ask otherwise), so the second compiles nothing.
    """
    from torch._dynamo.utils import counters

    if not activation_checkpointing:  # compiled here, not reused from another test's graphs in memory
        torch._dynamo.reset()
    counters.clear()
    eager, compiled = _models(activation_checkpointing)
    generator = torch.Generator().manual_seed(0)
    for first, (batch, length, target) in zip((True, False), ((5, 5, 5), (3, 7, 9))):
        src, tgt_in, tgt_out = _batch(generator, batch, length, target)
        results = []
        for model in (eager, compiled):
            model.train()
            model.zero_grad(set_to_none=True)
            with torch._dynamo.config.patch(error_on_recompile=not first):
                total, _ = model.loss(src, tgt_in, tgt_out, label_smoothing=0.1)
            total.backward()
            results.append((total.detach(), {n: p.grad for n, p in model.named_parameters()}))
        (loss_e, grads_e), (loss_c, grads_c) = results
        assert torch.allclose(loss_c, loss_e, rtol=1e-5), (loss_c, loss_e)
        for name, grad in grads_e.items():
            scale = max(grad.abs().max().item(), 1.0)
            assert torch.allclose(grads_c[name], grad, rtol=1e-4, atol=1e-6 * scale), name
        assert compiled.rng.state_dict() == eager.rng.state_dict()  # as many masks drawn
    aot = counters["aot_autograd"]
    assert not aot["autograd_cache_bypass"], aot
    assert activation_checkpointing or aot["autograd_cache_hit"] + aot["autograd_cache_saved"] >= 1, aot


def test_a_batch_or_length_of_one_runs_eagerly_without_recompiling():
    """Dynamo specializes sizes 1: such a micro-batch takes the eager layers, with the same result."""
    eager, compiled = _models(False)
    generator = torch.Generator().manual_seed(1)
    shapes = ((3, 7), (1, 9), (4, 1))
    batches = [_batch(generator, batch, length) for batch, length in shapes]
    for model in (eager, compiled):
        model.train()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for src, tgt_in, tgt_out in batches:
            if 1 in src.shape:
                src.clamp_(min=4)  # no padding: _batch pads the first sentence, which may be all of it
            totals = [model.loss(src, tgt_in, tgt_out, label_smoothing=0.1)[0] for model in (eager, compiled)]
            assert torch.allclose(totals[1], totals[0], rtol=1e-5), (src.shape, totals)


def test_compiled_layers_keep_no_boolean_activation_masks_for_backward():
    """Dropout and ReLU keep float masks: Inductor's CPU kernels store a boolean tensor ~15x slower.

    The booleans saved for backward are the padding, causal and loss masks of positions
    (at most batch x length or length x length elements), never an activation-sized mask.
    """
    _, compiled = _models(False)
    batch, length = 3, 7
    src, tgt_in, tgt_out = _batch(torch.Generator().manual_seed(0), batch, length)
    saved_booleans = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.bool:
            saved_booleans.append(tuple(t.shape))
        return t

    compiled.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        total, _ = compiled.loss(src, tgt_in, tgt_out, label_smoothing=0.1)
    total.backward()
    target = tgt_in.shape[1]  # the longer side
    positions = max(batch * target, target * target)
    assert saved_booleans and all(torch.Size(s).numel() <= positions for s in saved_booleans), saved_booleans


def test_a_compiled_model_decodes_eagerly_as_before():
    eager, compiled = _models(False)
    generator = torch.Generator().manual_seed(1)
    src, tgt_in, tgt_out = _batch(generator, 4, 9)
    compiled.loss(src, tgt_in, tgt_out)[0].backward()  # compiles the layers
    settings = SearchSettings(beam=3, lenpen=0.6, max_len_a=1.0, max_len_b=5)
    for model in (eager, compiled):
        model.eval()
    with torch.no_grad():
        hyps = [beam_search(m, src, settings) for m in (eager, compiled)]
    assert [h.tokens for h in hyps[0]] == [h.tokens for h in hyps[1]]


# ---- end to end -------------------------------------------------------------------------------
# Each compiled launch traces its layers again (~25 CPU seconds on 2 cores with a warm kernel
# cache, minutes with a cold one), so the runs below are shared: one eager reference and one
# compiled TP=2 run that is killed and resumed.


@pytest.fixture(scope="module")
def eager_run(corpus, tmp_path_factory) -> Path:
    """The eager TP=1 run, 20 steps: the reference the compiled runs share neither compiler nor sharding with."""
    run = tmp_path_factory.mktemp("eager") / "run"
    ok(train(run, 1, common(corpus) + ["train.max_steps=20", "train.save_interval=0"]))
    return run


@pytest.fixture(scope="module")
def compiled_tp2_run(corpus, tmp_path_factory) -> tuple[Path, list[dict]]:
    """TP=2 with train.compile, dropout on, checkpoints every 10 steps: rank 1 SIGKILLed after step
    13, then the run resumed to step 20. Returns the run and the records of the killed attempt."""
    run = tmp_path_factory.mktemp("compiled_tp2") / "run"
    sets = common(corpus) + ["parallel.tp=2", "train.max_steps=20", "train.compile=true"]
    first = train(run, 2, sets, fault="kill:rank=1:step=13")
    assert first.returncode != 0, first.stdout[-3000:]
    killed = train_records(run)
    second = train(run, 2, sets)
    ok(second)
    assert "resumed from" in second.stdout and "step-00000010" in second.stdout, second.stdout[-3000:]
    return run, killed


def test_compiled_tp2_follows_the_eager_unsharded_run(eager_run, compiled_tp2_run):
    """Compiled and sharded at once, killed and resumed, against the eager TP=1 run: all 20 steps.

    (A compiled TP=1 run between the two, compared with each, added ~45 s of compiling on
    2 AVX2 cores and nothing this comparison does not already catch.)
    """
    two, reference = losses(compiled_tp2_run[0]), losses(eager_run)
    assert sorted(two) == list(range(1, 21))
    for step in range(1, 21):
        assert abs(two[step]["loss"] - reference[step]["loss"]) <= 1e-4 * reference[step]["loss"], step


def test_compiled_run_killed_and_resumed_is_exact(compiled_tp2_run):
    """The steps the resumed run computed again (11 up to the kill) are bitwise the killed run's.

    The resumed process traces its layers afresh (or loads them from the compile caches), restores
    the weights, Adam's moments, the data position and the dropout streams from checkpoint 10:
    any of them restored wrong, or a compiled graph that drew other masks, changes step 11.
    """
    run, killed = compiled_tp2_run
    before = {r["step"]: r["loss"] for r in killed}
    assert {11, 12} <= set(before) and max(before) <= 13, sorted(before)
    replayed = [r for r in train_records(run)[len(killed) :] if r["step"] in before]
    assert [r["step"] for r in replayed] == [s for s in sorted(before) if s > 10]
    for r in replayed:
        assert r["loss"] == before[r["step"]], r["step"]


def test_a_compiled_runs_checkpoint_translates(compiled_tp2_run, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("a b c\nd e\n")
    proc = megaformer("translate", "--ckpt", compiled_tp2_run[0], "--input", source)
    ok(proc)
    assert proc.stdout.count("\n") == 2  # one line per sentence (a model of 20 steps may say nothing yet)
    assert "translated 2 sentences" in proc.stderr


def test_compiled_pipeline_follows_the_eager_run(corpus, eager_run, tmp_path):
    """pp=2 compiled, 4 steps, against the eager TP=1 run (test_pipeline holds eager pp=2 to pp=1)."""
    sets = common(corpus) + ["parallel.pp=2", "train.max_steps=4", "train.save_interval=0", "train.compile=true"]
    ok(train(tmp_path / "compiled", 2, sets))
    compiled, eager = losses(tmp_path / "compiled"), losses(eager_run)
    for step in range(1, 5):
        assert abs(compiled[step]["loss"] - eager[step]["loss"]) <= 1e-4 * eager[step]["loss"], step
