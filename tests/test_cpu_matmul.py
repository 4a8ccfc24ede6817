"""fp32 linear layers through oneDNN (megaformer/parallel/cpu_matmul.py).

The oneDNN products and gradients are checked against float64, torch's own paths against ``F.linear`` bit for bit.
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

    def set_choice(value: str, vendor: str = "AuthenticAMD", flags: str = "avx2 avx512f", isa: str = "") -> bool:
        monkeypatch.setenv("MEGAFORMER_CPU_MATMUL", value)
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa) if isa else monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", False)
        monkeypatch.setattr(cpu_matmul.cpuinfo, "cpu_field", lambda name, *_: vendor if name == "vendor_id" else flags)
        onednn_for_fp32.cache_clear()
        return onednn_for_fp32()

    yield set_choice
    onednn_for_fp32.cache_clear()


def _operands(rows: int = 37, inner: int = 256, out: int = 128):
    g = torch.Generator().manual_seed(0)
    return torch.randn(rows, 3, inner, generator=g), torch.randn(out, inner, generator=g), torch.randn(out, generator=g)


def test_the_choice_follows_the_setting_and_the_vendor(choose):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN")
    assert choose("auto", "AuthenticAMD") and not choose("auto", "GenuineIntel")
    assert not choose("auto", "AuthenticAMD", "avx2 fma")  # MKL's AVX2 kernels are oneDNN's there
    assert not choose("auto", isa="AVX2") and choose("auto", isa="AVX512_CORE_BF16")
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
            assert y.dtype == torch.float32 and y.shape == (37, 3, 128)
            wanted = exact if bias is not None else F.linear(x.double(), w.double())
            assert (y.double() - wanted).abs().max().item() < 1e-4
        assert (linear(x.transpose(0, 1), w, b).double() - exact.transpose(0, 1)).abs().max().item() < 1e-4


def test_training_through_onednn_gives_f_linears_gradients(choose):
    x, w, b = _operands()
    exact = [t.double().requires_grad_(True) for t in (x, w, b)]
    F.linear(*exact).square().sum().backward()
    for setting in ("onednn", "blas"):
        choose(setting)
        ours = [t.clone().requires_grad_(True) for t in (x, w, b)]
        y = linear(*ours)
        assert y.requires_grad and (y.double() - F.linear(*exact).detach()).abs().max().item() < 1e-4
        y.square().sum().backward()
        for mine, wanted in zip(ours, exact):
            assert ((mine.grad.double() - wanted.grad) / wanted.grad.abs().max()).abs().max().item() < 1e-6
    ours = [t.clone().requires_grad_(True) for t in (x, w)]  # no bias, and a frozen weight
    choose("onednn")
    linear(ours[0], ours[1].detach()).sum().backward()
    assert ours[0].grad is not None and ours[1].grad is None


def test_blas_bf16_and_narrow_layers_keep_torchs_own_arithmetic_bit_for_bit(choose):
    x, w, b = _operands()
    choose("onednn")
    narrow = w[:64].clone().requires_grad_(True)
    assert torch.equal(linear(x, narrow, b[:64]), F.linear(x, narrow, b[:64]))
    choose("blas")
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    choose("onednn")
    with torch.no_grad():
        half = linear(x.bfloat16(), w.bfloat16(), b.bfloat16())  # bf16: torch already takes oneDNN itself
    assert torch.equal(half, F.linear(x.bfloat16(), w.bfloat16(), b.bfloat16()))


def test_a_wrong_setting_stops_any_command_in_one_line(monkeypatch, capsys):
    from megaformer import cli

    monkeypatch.setenv("MEGAFORMER_CPU_MATMUL", "fastest")
    assert cli.main(["info", "--config", "configs/tiny.yaml"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "megaformer info: error: MEGAFORMER_CPU_MATMUL='fastest': expected one of auto, onednn, blas"
