"""fp32 linear layers through oneDNN without gradients (megaformer/parallel/cpu_matmul.py).

The oneDNN results are checked against float64, training's arithmetic against ``F.linear`` bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megaformer.errors import ConfigError
from megaformer.parallel import cpu_matmul
from megaformer.parallel.cpu_matmul import linear, onednn_for_fp32


@pytest.fixture
def choose(monkeypatch):
    """Set ``MEGAFORMER_CPU_MATMUL`` (and the CPU's vendor) for one test; the process's choice is made again."""

    def set_choice(value: str, vendor: str = "AuthenticAMD") -> bool:
        monkeypatch.setenv("MEGAFORMER_CPU_MATMUL", value)
        monkeypatch.setattr(cpu_matmul, "_cpu_vendor", lambda: vendor)
        onednn_for_fp32.cache_clear()
        return onednn_for_fp32()

    yield set_choice
    onednn_for_fp32.cache_clear()


def _operands(rows: int = 37, inner: int = 64, out: int = 48):
    g = torch.Generator().manual_seed(0)
    return torch.randn(rows, 3, inner, generator=g), torch.randn(out, inner, generator=g), torch.randn(out, generator=g)


def test_the_choice_follows_the_setting_and_the_vendor(choose):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN")
    assert choose("auto", "AuthenticAMD") and not choose("auto", "GenuineIntel")
    assert choose("onednn", "GenuineIntel") and not choose("blas", "AuthenticAMD")
    with pytest.raises(ConfigError, match="MEGAFORMER_CPU_MATMUL='fast': expected one of auto, onednn, blas"):
        choose("fast")


def test_without_gradients_onednn_computes_the_same_product(choose):
    x, w, b = _operands()
    exact = F.linear(x.double(), w.double(), b.double())
    choose("onednn")
    with torch.no_grad():
        for bias in (b, None):
            y = linear(x, w, bias)
            assert y.dtype == torch.float32 and y.shape == (37, 3, 48)
            wanted = exact if bias is not None else F.linear(x.double(), w.double())
            assert (y.double() - wanted).abs().max().item() < 1e-4
        assert (linear(x.transpose(0, 1), w, b).double() - exact.transpose(0, 1)).abs().max().item() < 1e-4


def test_training_keeps_torchs_own_arithmetic_bit_for_bit(choose):
    x, w, b = _operands()
    choose("onednn")
    w.requires_grad_(True)
    y = linear(x, w, b)
    assert torch.equal(y, F.linear(x, w, b)) and y.requires_grad
    choose("blas")
    with torch.no_grad():
        assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    choose("onednn")
    with torch.no_grad():
        half = linear(x.bfloat16(), w.bfloat16(), b.bfloat16())  # bf16: torch already takes oneDNN itself
    assert torch.equal(half, F.linear(x.bfloat16(), w.bfloat16(), b.bfloat16()))
