"""The one-kernel dropout and loss operators (megaformer/parallel/fused.py) against the CPU's own forms.

The operators run on GPUs (compiled) and on the meta device (the step's simulation); here their
eager and compiled functions run on CPU tensors and must give the CPU path's values: the
dropout bit for bit, forward and backward; the loss and its gradient to rounding, and the
loss against ``F.cross_entropy``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import megaformer.parallel.loss as loss_module
from megaformer.parallel import LOCAL, DropoutRNG, fused
from megaformer.parallel import rng as rng_module
from megaformer.parallel.loss import vocab_parallel_cross_entropy


def _fused_args(p: float, key: int) -> tuple:
    drop = rng_module._drop_levels(p)
    return key, drop - rng_module._LEVELS // 2, rng_module._LEVELS / (rng_module._LEVELS - drop)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_operator_is_the_cpu_masks_bit_for_bit_forward_and_backward(dtype):
    x = torch.randn(5, 11, 29, dtype=dtype, requires_grad=True)  # 1,595 elements: not a multiple of 4
    expected = DropoutRNG(7, LOCAL).dropout(x, 0.3, True)
    key = DropoutRNG(7, LOCAL).shared.next_keys(1, None)[0]
    got = fused.dropout(x, *_fused_args(0.3, key))
    assert torch.equal(got, expected)
    grad = torch.randn_like(x)
    (a,) = torch.autograd.grad(got, x, grad)
    (b,) = torch.autograd.grad(expected, x, grad)
    assert torch.equal(a, b)


def test_dropout_compiled_kernel_is_the_eager_masks():
    from megaformer.train.device import require_cpp_compiler

    require_cpp_compiler()
    x = torch.randn(3, 7, 40, dtype=torch.bfloat16)
    kernel = torch.compile(fused._dropout_math, dynamic=True, fullgraph=True)
    for key in DropoutRNG(3, LOCAL).shared.next_keys(2, None):
        _, threshold, scale = _fused_args(0.1, key)
        expected = fused._dropout_math(x, torch.full((), key, dtype=torch.int64), threshold, scale)
        assert torch.equal(kernel(x, torch.full((), key, dtype=torch.int64), threshold, scale), expected)


def test_dropout_off_the_cpu_is_one_operator_and_draws_the_same_keys(monkeypatch):
    rng = DropoutRNG(1, LOCAL)
    x = torch.empty(4, 9, 16, device="meta")
    names = []

    class Names(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            names.append(func._overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Names():
        rng.dropout(x, 0.1, True)
    assert names == ["dropout"]
    assert rng.state_dict()["shared"][1] == 1  # one key drawn, as on the CPU
    with fused.unfused(), Names():
        names.clear()
        rng.dropout(x, 0.1, True)
    assert len(names) > 5 and "dropout" not in names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_one_pass_form_equals_the_cpu_form_and_cross_entropy(monkeypatch, dtype):
    torch.manual_seed(0)
    vocab, padded = 290, 300  # the table padded past the vocabulary
    z = torch.randn(37, padded, dtype=dtype, requires_grad=True)
    t = torch.randint(1, vocab, (37,))
    t[3] = 0  # ignored
    cpu = vocab_parallel_cross_entropy(z, t, LOCAL, vocab, 0.1, 0)
    (cpu_grad,) = torch.autograd.grad(cpu.sum(), z)
    monkeypatch.setattr(loss_module, "_cpu_form", lambda device: False)
    one_pass = vocab_parallel_cross_entropy(z, t, LOCAL, vocab, 0.1, 0)
    (grad,) = torch.autograd.grad(one_pass.sum(), z)
    reference = F.cross_entropy(z[:, :vocab].float(), t, label_smoothing=0.1, ignore_index=0, reduction="none")
    assert torch.equal(one_pass, cpu)
    assert torch.allclose(one_pass, reference, atol=2e-6)
    assert torch.allclose(grad.float(), cpu_grad.float(), atol=1e-6, rtol=0)
    assert grad.dtype == dtype and not grad[:, vocab:].any()  # padded rows get nothing


def test_loss_operators_compiled_equal_their_eager_form():
    from megaformer.train.device import require_cpp_compiler

    require_cpp_compiler()
    z = torch.randn(23, 130, dtype=torch.bfloat16)
    m = z.float().amax(-1)
    sums = torch.compile(fused._sums_math, dynamic=True)(z, m, -86.0)
    assert torch.allclose(sums, fused._sums_math(z, m, -86.0), rtol=1e-6)
    args = (z, m, -86.0, torch.rand(23), torch.rand(23), torch.randint(0, 120, (23,)), torch.rand(23), 120)
    assert torch.equal(torch.compile(fused._grad_math, dynamic=True)(*args), fused._grad_math(*args))


def test_gpu_forms_train_tiny_as_the_cpu_forms(monkeypatch):
    """20 steps of the tiny model (fp32, dropout and label smoothing) through the GPU's forms on CPU tensors:
    the same masks and losses as the CPU's forms to rounding (the gradient's sum is ordered otherwise)."""
    from megaformer.config import load_config
    from megaformer.model import Transformer

    cfg = load_config("configs/tiny.yaml", ["model.dropout=0.3"])
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(4, 1000, (16, 12), generator=g) for _ in range(20)]

    def losses() -> list[float]:
        rng = DropoutRNG(1, LOCAL)
        model = Transformer(cfg.model, 1000, LOCAL, rng, seed=1).train()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        out = []
        for ids in batches:
            loss, tokens = model.loss(ids, ids, ids, 0.1)
            (loss / tokens).backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    cpu = losses()
    monkeypatch.setattr(loss_module, "_cpu_form", lambda device: False)
    monkeypatch.setattr(DropoutRNG, "_one_kernel", lambda self, x, split_dim: True)
    gpu_forms = losses()
    assert gpu_forms[0] == cpu[0]  # the same masks and loss before any update
    assert max(abs(a - b) / b for a, b in zip(gpu_forms, cpu, strict=True)) < 1e-4
