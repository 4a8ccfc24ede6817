"""Each parallel layer against an unsharded torch reference: outputs and gradients, TP in {1, 2, 4}.

Every check runs in ``tp`` gloo processes (one spawn per TP size runs them all); the
reference is a plain ``torch.nn`` layer holding the full weight, computed on every rank.
A mismatch is recorded, not raised, so that every check still runs its collectives on
every rank (no rank is left waiting) and the test reports every failure, not the first.
"""

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from launcher.local import spawn
from megaformer.config import ParallelConfig
from megaformer.parallel import (
    ColumnParallelLinear,
    LayerNorm,
    ParallelContext,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_from_sequence,
    gather_full,
    scatter_to_sequence,
    scatter_to_tp,
    shard_full,
    vocab_parallel_cross_entropy,
)
from megaformer.parallel import loss as loss_module
from megaformer.parallel.groups import TPGroup

B, S, D, OUT = 3, 8, 16, 24  # S and every width divisible by 4


FAILURES: list[str] = []  # this worker process's mismatches, reported together at its end


def expect(condition: bool, what: str) -> None:
    if not condition:
        FAILURES.append(what)


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Equal shapes, and the largest difference within 1e-5 of the reference's largest magnitude (fp32)."""
    if a.shape != b.shape:
        FAILURES.append(f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}")
        return
    diff, scale = (a - b).abs().max().item(), b.abs().max().item()
    expect(diff <= 1e-5 * max(scale, 1e-6), f"{what}: max abs diff {diff:.3e}, reference scale {scale:.3e}")


def _inputs(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _seq_part(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    n = x.shape[1] // tp.size
    return x[:, tp.rank * n : (tp.rank + 1) * n]


def check_column(tp: TPGroup, sequence_parallel: bool, partitions: int, gather_output: bool) -> None:
    full_w, full_b = _inputs(1, partitions * OUT, D), _inputs(2, partitions * OUT)
    ref = nn.Linear(D, partitions * OUT)
    layer = ColumnParallelLinear(
        D, partitions * OUT, tp, partitions=partitions, gather_output=gather_output, sequence_parallel=sequence_parallel
    )
    with torch.no_grad():
        ref.weight.copy_(full_w), ref.bias.copy_(full_b)
        (
            layer.weight.copy_(shard_full(full_w, 0, partitions, tp)),
            layer.bias.copy_(shard_full(full_b, 0, partitions, tp)),
        )
    x = _inputs(3, B, S, D)
    x_ref, x_local = (
        x.clone().requires_grad_(),
        (_seq_part(x, tp) if sequence_parallel and tp.size > 1 else x).clone().requires_grad_(),
    )
    y_ref, y = ref(x_ref), layer(x_local)
    grad = _inputs(4, *y_ref.shape)
    expected = y_ref if gather_output else shard_full(y_ref, 2, partitions, tp)
    close(y, expected.detach(), "column output")
    (y_ref * grad).sum().backward()
    (y * (grad if gather_output else shard_full(grad, 2, partitions, tp))).sum().backward()
    expected_dx = _seq_part(x_ref.grad, tp) if sequence_parallel and tp.size > 1 else x_ref.grad
    close(x_local.grad, expected_dx, "column input grad")
    close(gather_full(layer.weight.grad, 0, partitions, tp), ref.weight.grad, "column weight grad")
    close(gather_full(layer.bias.grad, 0, partitions, tp), ref.bias.grad, "column bias grad")


def check_row(tp: TPGroup, sequence_parallel: bool) -> None:
    full_w, full_b = _inputs(5, OUT, D), _inputs(6, OUT)
    ref = nn.Linear(D, OUT)
    layer = RowParallelLinear(D, OUT, tp, sequence_parallel=sequence_parallel)
    with torch.no_grad():
        ref.weight.copy_(full_w), ref.bias.copy_(full_b)
        layer.weight.copy_(shard_full(full_w, 1, 1, tp)), layer.bias.copy_(full_b)
    x = _inputs(7, B, S, D)
    x_ref = x.clone().requires_grad_()
    x_local = shard_full(x, 2, 1, tp).requires_grad_()
    y_ref, y = ref(x_ref), layer(x_local)
    grad = _inputs(8, *y_ref.shape)
    sp = sequence_parallel and tp.size > 1
    close(y, (_seq_part(y_ref, tp) if sp else y_ref).detach(), "row output")
    (y_ref * grad).sum().backward()
    (y * (_seq_part(grad, tp) if sp else grad)).sum().backward()
    close(x_local.grad, shard_full(x_ref.grad, 2, 1, tp), "row input grad")
    close(gather_full(layer.weight.grad, 1, 1, tp), ref.weight.grad, "row weight grad")
    close(layer.bias.grad, ref.bias.grad, "row bias grad")


def check_embedding(tp: TPGroup, sequence_parallel: bool) -> None:
    vocab = 40  # divisible by 1, 2, 4
    full = _inputs(9, vocab, D)
    ref = nn.Embedding(vocab, D)
    layer = VocabParallelEmbedding(vocab, D, tp, sequence_parallel=sequence_parallel)
    with torch.no_grad():
        ref.weight.copy_(full), layer.weight.copy_(shard_full(full, 0, 1, tp))
    ids = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(10))
    y_ref, y = ref(ids), layer(ids)
    sp = sequence_parallel and tp.size > 1
    grad = _inputs(11, *y_ref.shape)
    close(y, (_seq_part(y_ref, tp) if sp else y_ref).detach(), "embedding output")
    # The tied output projection: this rank's slice of x E^T.
    h = _inputs(12, B, S, D)
    logits_ref = F.linear(h, ref.weight)
    logits = layer.logits(_seq_part(h, tp) if sp else h)
    close(logits, shard_full(logits_ref, 2, 1, tp).detach(), "output logits")
    gl = _inputs(13, *logits_ref.shape)
    ((y_ref * grad).sum() + (logits_ref * gl).sum()).backward()
    ((y * (_seq_part(grad, tp) if sp else grad)).sum() + (logits * shard_full(gl, 2, 1, tp)).sum()).backward()
    close(gather_full(layer.weight.grad, 0, 1, tp), ref.weight.grad, "embedding grad")


def check_layernorm(tp: TPGroup) -> None:
    ref = nn.LayerNorm(D)
    layer = LayerNorm(D, tp, sequence_parallel=True)
    with torch.no_grad():
        w, b = _inputs(14, D), _inputs(15, D)
        ref.weight.copy_(w), ref.bias.copy_(b), layer.weight.copy_(w), layer.bias.copy_(b)
    x = _inputs(16, B, S, D)
    y_ref, y = ref(x), layer(_seq_part(x, tp))
    grad = _inputs(17, *y_ref.shape)
    close(y, _seq_part(y_ref, tp).detach(), "layernorm output")
    (y_ref * grad).sum().backward()
    (y * _seq_part(grad, tp)).sum().backward()
    close(layer.weight.grad, ref.weight.grad, "sequence-parallel layernorm weight grad")
    close(layer.bias.grad, ref.bias.grad, "sequence-parallel layernorm bias grad")


def check_comm_pairs(tp: TPGroup) -> None:
    """scatter/gather along the sequence and the last dimension invert each other, with gradients."""
    x = _inputs(18, B, S, D).requires_grad_()
    y = gather_from_sequence(scatter_to_sequence(x, tp), tp)
    close(y, x.detach() if tp.size == 1 else x.detach(), "sequence round trip")
    z = scatter_to_tp(x, tp)
    close(z, shard_full(x.detach(), 2, 1, tp), "scatter_to_tp")


# The loss's passes in their CPU form with all rows in one block, in that form with a few
# rows a block (the tests' shapes are far below the real block size), and in the form a GPU
# runs (one pass a kernel, mixed-dtype element-wise ops), run here on the CPU.
LOSS_FORMS = ["cpu", "cpu-blocks", "gpu"]  # in this order: a form keeps what the one before set


def _use_loss_form(form: str, setattr_) -> None:
    """Make the loss take ``form`` (one of LOSS_FORMS) through ``setattr_(name, value)`` on its module."""
    if form == "cpu-blocks":
        setattr_("CPU_BLOCK_ELEMENTS", 100)  # 1-3 rows a block at these widths
    if form == "gpu":
        setattr_("_cpu_form", lambda device: False)


def check_loss(tp: TPGroup, smoothing: float) -> None:
    vocab, padded, pad = 50, 64, 0
    n = 20
    full = _inputs(19, n, padded) * 3
    target = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(20))
    target[::5] = pad
    ref_logits = full[:, :vocab].clone().requires_grad_()
    ref = F.cross_entropy(ref_logits, target, label_smoothing=smoothing, ignore_index=pad, reduction="sum")
    local = shard_full(full, 1, 1, tp).requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, tp, vocab, smoothing, pad)
    expect(bool((loss[target == pad] == 0).all()), "padding targets have a non-zero loss")
    close(loss.sum(), ref.detach(), f"loss (smoothing {smoothing})")
    ref.backward()
    loss.sum().backward()
    grad_full = gather_full(local.grad, 1, 1, tp)
    close(grad_full[:, :vocab], ref_logits.grad, "loss grad")
    expect(bool((grad_full[:, vocab:] == 0).all()), "padded vocabulary rows got gradient")


def _worker(tp_size: int) -> int:
    import os

    ctx = ParallelContext.initialize(ParallelConfig(tp=tp_size, backend="gloo"), int(os.environ["RANK"]), tp_size)
    tp = ctx.tp
    for sp in (False, True):
        for partitions in (1, 3):
            check_column(tp, sp, partitions, gather_output=False)
        check_column(tp, sp, partitions=1, gather_output=True)
        check_row(tp, sp)
        check_embedding(tp, sp)
    check_layernorm(tp)
    check_comm_pairs(tp)
    for form in LOSS_FORMS:
        _use_loss_form(form, lambda name, value: setattr(loss_module, name, value))
        for smoothing in (0.0, 0.1):
            check_loss(tp, smoothing)
    ctx.destroy()
    for failure in FAILURES:
        print(f"rank {ctx.rank} (tp={tp_size}): {failure}", flush=True)
    return 1 if FAILURES else 0


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_parallel_layers_match_torch(tp):
    assert spawn(_worker, tp, tp) == 0


@pytest.mark.parametrize("form", LOSS_FORMS)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_fp64_loss_is_computed_in_fp64(smoothing, form, monkeypatch):
    """fp64 logits keep fp64 through the loss and its gradient (fp64 parity checks rely on it)."""
    from megaformer.parallel import LOCAL

    _use_loss_form(form, partial(monkeypatch.setattr, loss_module))

    vocab, n = 50, 20
    logits = (torch.randn(n, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3).requires_grad_()
    target = torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(4))
    ref_logits = logits.detach()[:, :vocab].clone().requires_grad_()
    ref = F.cross_entropy(ref_logits, target, label_smoothing=smoothing, reduction="sum")
    loss = vocab_parallel_cross_entropy(logits, target, LOCAL, vocab, smoothing).sum()
    loss.backward()
    ref.backward()
    assert loss.dtype == logits.grad.dtype == torch.float64
    assert abs(loss.item() - ref.item()) <= 1e-12 * abs(ref.item())
    assert (logits.grad[:, :vocab] - ref_logits.grad).abs().max().item() <= 1e-14


@pytest.mark.parametrize("form", LOSS_FORMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_loss_of_half_precision_logits_is_fp32_with_one_full_size_buffer(dtype, form, monkeypatch):
    """bf16/fp16 logits: loss and gradient as F.cross_entropy of their fp32 values; one (N, V) tensor saved: an fp32
    buffer in the CPU's forms, the logits themselves in the GPU's one-pass form (no fp32 copy of N x V)."""
    from megaformer.parallel import LOCAL

    _use_loss_form(form, partial(monkeypatch.setattr, loss_module))

    vocab, n = 300, 48
    logits = (torch.randn(n, 320, generator=torch.Generator().manual_seed(5)) * 4).to(dtype).requires_grad_()
    target = torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(6))
    ref_logits = logits.detach()[:, :vocab].float().requires_grad_()
    ref = F.cross_entropy(ref_logits, target, label_smoothing=0.1, reduction="sum")
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = vocab_parallel_cross_entropy(logits, target, LOCAL, vocab, 0.1)
    assert loss.dtype == torch.float32
    kept = [t for t in saved if t.numel() >= n * vocab]
    assert [t.dtype for t in kept] == [dtype if form == "gpu" else torch.float32]
    assert form != "gpu" or kept[0] is logits
    loss.sum().backward()
    ref.backward()
    assert abs(loss.sum().item() - ref.item()) <= 1e-5 * abs(ref.item())
    assert logits.grad.dtype == dtype and bool((logits.grad[:, vocab:] == 0).all())
    step = torch.finfo(dtype).eps  # the gradient is rounded once, to the logits' dtype
    assert (logits.grad[:, :vocab].float() - ref_logits.grad).abs().max().item() <= step


@pytest.mark.parametrize("form", LOSS_FORMS)
@pytest.mark.parametrize("dtype, spread", [(torch.float32, 60.0), (torch.float64, 600.0)])
def test_loss_of_logits_whose_probabilities_underflow(dtype, spread, form, monkeypatch):
    """Most of the vocabulary below the dtype's smallest normal probability: loss and gradient as F.cross_entropy's."""
    from megaformer.parallel import LOCAL

    _use_loss_form(form, partial(monkeypatch.setattr, loss_module))

    vocab, n = 1000, 32
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(n, vocab, generator=g, dtype=torch.float64) * spread).to(dtype).requires_grad_()
    target = torch.randint(1, vocab, (n,), generator=g)
    tiny = torch.finfo(dtype).tiny
    shifted = logits.detach().double() - logits.detach().double().amax(-1, keepdim=True)
    assert (shifted.exp() < tiny).double().mean() > 0.5  # the case: most probabilities would be subnormal or 0
    ref_logits = logits.detach().double().requires_grad_()  # the reference computes in fp64 throughout
    ref = F.cross_entropy(ref_logits, target, label_smoothing=0.1, reduction="sum")
    ref.backward()
    loss = vocab_parallel_cross_entropy(logits, target, LOCAL, vocab, 0.1).sum()
    loss.backward()
    rel = 1e-6 if dtype == torch.float32 else 1e-12
    assert abs(loss.item() - ref.item()) <= rel * abs(ref.item())
    assert (logits.grad.double() - ref_logits.grad).abs().max().item() <= rel
