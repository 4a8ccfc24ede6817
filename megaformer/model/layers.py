"""The feed-forward network and the encoder and decoder layers.

A layer's forward is its residual lines. ``norm: post`` is the paper's order,
LayerNorm(x + Dropout(Sublayer(x))); ``norm: pre`` is x + Dropout(Sublayer(LayerNorm(x))).
Under sequence parallelism ``x`` is this rank's part of the sequence everywhere
outside the attention and feed-forward blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megaformer.config import ModelConfig
from megaformer.model.attention import CrossAttention, SelfAttention
from megaformer.parallel import ColumnParallelLinear, Dropout, DropoutRNG, LayerNorm, RowParallelLinear, TPGroup
from megaformer.parallel.comm import SEQ_DIM


class _ReLU(torch.autograd.Function):
    """max(0, x) whose backward multiplies by sign(output) instead of reading a boolean mask.

    For compiled layers: Inductor computes ``F.relu``'s mask in the forward and keeps it
    as a boolean tensor, which its CPU kernels store ~15x slower than a float one
    (torch 2.13). The output is kept anyway (for fc2's weight gradient), so this keeps
    nothing more. The gradient is the same: sign(output) is 1 where x > 0, else 0.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = x.clamp_min(0)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (out,) = ctx.saved_tensors
        return grad * out.sign()


_relu = _ReLU.apply


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W_1 + b_1) W_2 + b_2 with W_1 split by columns and W_2 by rows."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, rng: DropoutRNG, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(cfg.d_model, cfg.d_ff, tp, sequence_parallel=sequence_parallel)
        self.fc2 = RowParallelLinear(cfg.d_ff, cfg.d_model, tp, sequence_parallel=sequence_parallel)
        self.dropout = Dropout(cfg.activation_dropout, rng, split_dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)  # (batch, len, d_ff / tp)
        h = _relu(h) if torch.compiler.is_compiling() else F.relu(h)  # eagerly, F.relu's backward is one kernel
        return self.fc2(self.dropout(h))


class _Residual(nn.Module):
    """Shared residual wiring of the encoder and decoder layers."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, rng: DropoutRNG, sequence_parallel: bool) -> None:
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        self.dropout = Dropout(cfg.dropout, rng, split_dim=SEQ_DIM if sequence_parallel and tp.size > 1 else None)

    def _draws(self, residuals: int, *sites: nn.Module) -> dict[str, int]:
        """Masks one training forward draws per stream: ``residuals`` residual dropouts, then each site's."""
        counts = {k: v * residuals for k, v in self.dropout.mask_draws().items()}
        for site in sites:
            for k, v in site.mask_draws().items():
                counts[k] += v
        return counts

    def residual(
        self, x: torch.Tensor, norm: LayerNorm, sublayer: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        if self.pre_norm:
            return x + self.dropout(sublayer(norm(x)))
        return norm(x + self.dropout(sublayer(x)))


class EncoderLayer(_Residual):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, rng: DropoutRNG, sequence_parallel: bool = False) -> None:
        super().__init__(cfg, tp, rng, sequence_parallel)
        sp = sequence_parallel
        self.self_attn = SelfAttention(cfg.d_model, cfg.num_heads, tp, rng, False, cfg.attention_dropout, sp)
        self.ffn = FeedForward(cfg, tp, rng, sp)
        self.norm1 = LayerNorm(cfg.d_model, tp, cfg.layernorm_eps, sp)
        self.norm2 = LayerNorm(cfg.d_model, tp, cfg.layernorm_eps, sp)

    def mask_draws(self) -> dict[str, int]:
        return self._draws(2, self.self_attn, self.ffn.dropout)

    def forward(self, x: torch.Tensor, src_mask: torch.Tensor | None) -> torch.Tensor:
        x = self.residual(x, self.norm1, lambda h: self.self_attn(h, src_mask))
        x = self.residual(x, self.norm2, self.ffn)
        return x


class DecoderLayer(_Residual):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, rng: DropoutRNG, sequence_parallel: bool = False) -> None:
        super().__init__(cfg, tp, rng, sequence_parallel)
        sp = sequence_parallel
        self.self_attn = SelfAttention(cfg.d_model, cfg.num_heads, tp, rng, True, cfg.attention_dropout, sp)
        self.cross_attn = CrossAttention(cfg.d_model, cfg.num_heads, tp, rng, cfg.attention_dropout, sp)
        self.ffn = FeedForward(cfg, tp, rng, sp)
        self.norm1 = LayerNorm(cfg.d_model, tp, cfg.layernorm_eps, sp)
        self.norm2 = LayerNorm(cfg.d_model, tp, cfg.layernorm_eps, sp)
        self.norm3 = LayerNorm(cfg.d_model, tp, cfg.layernorm_eps, sp)

    def mask_draws(self) -> dict[str, int]:
        return self._draws(3, self.self_attn, self.cross_attn, self.ffn.dropout)

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        memory_mask: torch.Tensor | None,
        self_cache: dict | None = None,
        cross_cache: dict | None = None,
    ) -> torch.Tensor:
        x = self.residual(x, self.norm1, lambda h: self.self_attn(h, None, self_cache))
        x = self.residual(x, self.norm2, lambda h: self.cross_attn(h, memory, memory_mask, cross_cache))
        x = self.residual(x, self.norm3, self.ffn)
        return x
