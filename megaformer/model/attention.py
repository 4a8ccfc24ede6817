"""Multi-head attention with heads split across tensor-parallel ranks, and the decoding cache.

Each rank owns ``num_heads / tp`` whole heads: the fused QKV (or Q and fused KV for
cross-attention) projection is column-parallel, attention is local to the rank, and
the output projection is row-parallel, so one attention block costs one all-reduce
in forward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megaformer.parallel import ColumnParallelLinear, DropoutRNG, RowParallelLinear, TPGroup


class DecoderCache:
    """Per-layer keys and values kept between decoding steps.

    Self-attention keys/values grow by one position a step, a row per hypothesis;
    cross-attention keys/values are computed once per source, a row per source (the
    hypotheses of one source share them, see :class:`CrossAttention`). :meth:`reorder`
    follows beam search.
    """

    def __init__(self, num_layers: int) -> None:
        self.self_attn: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers)]
        self.cross_attn: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers)]

    @property
    def length(self) -> int:
        """Target positions already decoded."""
        first = self.self_attn[0]
        return first["k"].shape[2] if first else 0

    def reorder(self, index: torch.Tensor, sources: torch.Tensor | None = None) -> None:
        """Keep the hypotheses ``index`` (beam search's survivors) and, where given, the sources ``sources``."""
        for layers, rows in ((self.self_attn, index), (self.cross_attn, sources)):
            if rows is None:
                continue
            for layer in layers:
                for name, t in layer.items():
                    layer[name] = t.index_select(0, rows)


def freeze_key_bias(bias: torch.Tensor, blocks: int, key_block: int) -> None:
    """Keep the key part of a fused projection's bias at exactly zero.

    A bias on the keys adds q . b to every score of a query: softmax is unchanged, so its
    true gradient is zero and what backward computes is rounding noise, which Adam
    (eps 1e-9) would turn into steps of size lr. The hook zeroes that part of the
    gradient, so the bias stays at its initial zero and runs do not depend on noise
    (a different grouping of micro-batches, another TP size).
    """

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(blocks, -1)[key_block].zero_()
        return grad

    bias.register_hook(hook)


def split_heads(fused: torch.Tensor, blocks: int, heads: int, head_dim: int) -> list[torch.Tensor]:
    """(batch, len, blocks * heads * head_dim) -> ``blocks`` strided views (batch, heads, len, head_dim).

    Views, not copies: SDPA takes strided inputs. Splitting the last dimension (rather
    than unbinding a (blocks, batch, heads, len, head_dim) permutation) makes the
    backward one ``cat`` of the gradients straight into the fused layout; unbind's
    backward stacks them and then copies the stack into that layout.
    """
    b, t = fused.shape[:2]
    return [block.view(b, t, heads, head_dim).transpose(1, 2) for block in fused.split(heads * head_dim, dim=-1)]


# On a CPU, SDPA's fused (flash) kernel is slower than three plain ops for the short
# sequences of translation. Forward and backward of one (32, 8, 30, 64) attention:
# 15.2 ms in bf16 against 4.1 ms for matmul, fp32 softmax and matmul (fp32: 4.5 against
# 3.3). In bf16 the matmuls (what AMX and AVX512-BF16 run fast) stay ahead up to 128 keys
# (16.4 against 12.5 ms) and draw level at 256; in fp32 they fall behind from ~64 keys
# (2.2 against 2.5 ms). On a GPU the fused kernels win at every length. Measured on the
# 2-core development machine with benchmarks/attention.py.
CPU_MATMUL_MAX_KEYS_FP32 = 48
CPU_MATMUL_MAX_KEYS_BF16 = 128  # and fp16


def uses_matmul_attention(q: torch.Tensor, k: torch.Tensor, dropout_p: float) -> bool:
    """Whether :func:`attend` computes the scores with matmuls (or calls SDPA's fused kernel)."""
    if dropout_p > 0.0:
        return True
    limit = CPU_MATMUL_MAX_KEYS_FP32 if q.dtype == torch.float32 else CPU_MATMUL_MAX_KEYS_BF16
    return q.device.type == "cpu" and k.shape[-2] <= limit


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    dropout_p: float,
    rng: DropoutRNG,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v for (batch, heads, len, head_dim) tensors.

    ``mask`` is boolean, True where a key may be attended, broadcast to
    (batch, heads, tgt_len, src_len). On a GPU, and for long sources on a CPU, this is
    one call of ``scaled_dot_product_attention``; otherwise (see
    :func:`uses_matmul_attention`), and always with attention dropout, the scores
    are a matmul, the softmax runs in fp32 and the probabilities are dropped with a
    mask from the TP-aware stream (split along heads, dimension 1).
    """
    t, s = q.shape[-2], k.shape[-2]
    causal = causal and t > 1  # one new query sees every cached key
    if uses_matmul_attention(q, k, dropout_p):
        return matmul_attention(q, k, v, mask, causal, dropout_p, rng)
    if causal and (mask is not None or t != s):
        # Query i sits at position s - t + i: it sees keys 0 .. s - t + i (bottom-right aligned).
        causal_mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
        mask = causal_mask if mask is None else mask & causal_mask
        causal = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


def matmul_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    dropout_p: float,
    rng: DropoutRNG,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v as two matmuls and an fp32 softmax, probabilities dropped with ``dropout_p``.

    The softmax runs in at least fp32: bf16/fp16 scores go up, float64 ones stay float64.
    Rounding float64 scores to fp32 would make the result depend on where a row falls in
    a vector register (the vector and scalar fp32 kernels round differently).

    The masks are added (0 where a key may be attended, -inf where not) together with the
    scaling, in one operator: ``masked_fill`` of the scores would be ~5x slower on a CPU
    (forward and backward) and would need the inverted boolean mask made at every call.
    The scores are the same bit for bit.
    """
    scores = torch.matmul(q, k.transpose(-2, -1))  # (batch, heads, t, s)
    if scores.dtype in (torch.bfloat16, torch.float16):
        scores = scores.float()
    bias = None
    if mask is not None:
        bias = mask.to(scores.dtype).log()  # log(1) = 0, log(0) = -inf
    if causal:
        # Query i sits at position s - t + i: it sees keys 0 .. s - t + i (bottom-right aligned).
        t, s = scores.shape[-2:]
        future = torch.full((t, s), float("-inf"), dtype=scores.dtype, device=scores.device).triu(s - t + 1)
        bias = future if bias is None else bias + future
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = scores * scale if bias is None else torch.add(bias, scores, alpha=scale)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    probs = rng.dropout(probs, dropout_p, dropout_p > 0.0, split_dim=1)
    return torch.matmul(probs, v)


class SelfAttention(nn.Module):
    """Self-attention with a fused, column-parallel QKV projection (whole heads per rank)."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        tp: TPGroup,
        rng: DropoutRNG,
        causal: bool,
        attention_dropout: float = 0.0,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.heads = num_heads // tp.size
        self.head_dim = d_model // num_heads
        self.causal = causal
        self.rng = rng
        self.attention_dropout = attention_dropout
        self.qkv = ColumnParallelLinear(d_model, 3 * d_model, tp, partitions=3, sequence_parallel=sequence_parallel)
        freeze_key_bias(self.qkv.bias, blocks=3, key_block=1)
        self.out = RowParallelLinear(d_model, d_model, tp, sequence_parallel=sequence_parallel)

    def mask_draws(self) -> dict[str, int]:
        """Masks one training forward draws from each stream: the attention probabilities' (split by heads)."""
        return self.rng.draws_of(self.attention_dropout, 1)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        qkv = self.qkv(x)  # (batch, len, 3 * heads * head_dim), this rank's heads
        b, t = qkv.shape[:2]
        q, k, v = split_heads(qkv, 3, self.heads, self.head_dim)  # each (batch, heads, len, head_dim)
        causal = self.causal
        if cache is not None:
            if cache:
                k = torch.cat([cache["k"], k], dim=2)
                v = torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
        p = self.attention_dropout if self.training else 0.0
        heads = attend(q, k, v, mask, causal, p, self.rng)  # (batch, heads, len, head_dim)
        return self.out(heads.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class CrossAttention(nn.Module):
    """Decoder-to-encoder attention: column-parallel Q and fused KV, row-parallel output."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        tp: TPGroup,
        rng: DropoutRNG,
        attention_dropout: float = 0.0,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.heads = num_heads // tp.size
        self.head_dim = d_model // num_heads
        self.rng = rng
        self.attention_dropout = attention_dropout
        self.q = ColumnParallelLinear(d_model, d_model, tp, sequence_parallel=sequence_parallel)
        self.kv = ColumnParallelLinear(d_model, 2 * d_model, tp, partitions=2, sequence_parallel=sequence_parallel)
        freeze_key_bias(self.kv.bias, blocks=2, key_block=0)
        self.out = RowParallelLinear(d_model, d_model, tp, sequence_parallel=sequence_parallel)

    def mask_draws(self) -> dict[str, int]:
        """Masks one training forward draws from each stream: the attention probabilities' (split by heads)."""
        return self.rng.draws_of(self.attention_dropout, 1)

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        memory_mask: torch.Tensor | None,
        cache: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        q = self.q(x)
        b, t = q.shape[:2]
        if cache:
            k, v = cache["k"], cache["v"]
        else:
            k, v = split_heads(
                self.kv(memory), 2, self.heads, self.head_dim
            )  # each (sources, heads, src_len, head_dim)
            if cache is not None:  # contiguous once: each step's matmuls then read them as they are
                k, v = cache["k"], cache["v"] = k.contiguous(), v.contiguous()
        # ``group`` consecutive rows of x attend to one source (beam search's hypotheses of a sentence): their
        # queries side by side, (sources, heads, group * tgt_len, head_dim), against keys computed once per source
        sources = k.shape[0]
        if b % sources:
            raise ValueError(f"{b} target rows cannot share {sources} sources in equal groups")
        q = q.view(sources, b // sources * t, self.heads, self.head_dim).transpose(1, 2)
        p = self.attention_dropout if self.training else 0.0
        heads = attend(q, k, v, memory_mask, False, p, self.rng)
        return self.out(heads.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))
