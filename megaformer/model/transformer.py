"""The encoder-decoder Transformer of "Attention Is All You Need", tensor-parallel.

One vocab-parallel embedding table serves the encoder input, the decoder input and
the output projection (paper 3.4), scaled by sqrt(d_model); sinusoidal positions
(3.5); N encoder and N decoder layers (3.1). The logits stay split over the TP group:
the loss (:mod:`megaformer.parallel.loss`) and beam search work on the slices.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from contextlib import contextmanager, nullcontext

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megaformer.config import Config, ModelConfig
from megaformer.data.tokenizer import PAD_ID
from megaformer.model.attention import DecoderCache
from megaformer.model.layers import DecoderLayer, EncoderLayer
from megaformer.parallel import (
    Dropout,
    DropoutRNG,
    LayerNorm,
    TPGroup,
    VocabParallelEmbedding,
    check_model_split,
    init_parameters,
    padded_vocab_size,
    vocab_parallel_cross_entropy,
)
from megaformer.parallel.comm import SEQ_DIM
from megaformer.parallel.stages import COPY, StagePart


def sinusoidal_positions(length: int, d_model: int) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)); (length, d_model)."""
    pos = torch.arange(length, dtype=torch.float64).unsqueeze(1)
    inv = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    pe = torch.zeros(length, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(pos * inv)
    pe[:, 1::2] = torch.cos(pos * inv)[:, : d_model // 2]
    return pe.float()


def pad_to_multiple(ids: torch.Tensor, multiple: int, pad_id: int) -> torch.Tensor:
    """``ids`` with its length padded to a multiple of ``multiple`` (sequence parallelism splits it evenly)."""
    extra = -ids.shape[1] % multiple
    return ids if extra == 0 else torch.nn.functional.pad(ids, (0, extra), value=pad_id)


def _sizes_of_their_own(args: tuple) -> None:
    """Give a compiled layer's batch and lengths a symbol each, also where two are equal.

    Dynamo otherwise gives sizes that happen to be equal in the call that compiles one
    symbol (duck sizing): a first micro-batch of as many sentences as tokens, or with a
    source as long as its target, compiles a graph that holds only for such batches, and
    the next one compiles the layer again (~30 s on 2 CPU cores, docs/results.md).
    Every dimension is marked but an activation's last (its width, fixed by the weights),
    in the tensor and in the one it views (a mask is a view of the (batch, length) padding
    flags); the same marks every call, as Dynamo guards on them. Only a call that compiles
    reads them.
    """
    for arg in args:
        if isinstance(arg, torch.Tensor):
            for tensor in (arg,) if arg._base is None else (arg, arg._base):
                dims = tensor.dim() - 1 if tensor.is_floating_point() else tensor.dim()
                torch._dynamo.maybe_mark_dynamic(tensor, tuple(range(dims)))


class Transformer(nn.Module):
    """Encoder-decoder Transformer whose heads, d_ff and vocabulary are split over ``tp``.

    ``vocab_size`` is the tokenizer's size; the table is padded to
    :func:`padded_vocab_size` rows and the padding never gets probability.
    Parameters are initialised from ``seed`` independently of the TP size.
    """

    @classmethod
    def of_run(cls, cfg: Config, tp: TPGroup, rng: DropoutRNG, part: StagePart | None = None) -> Transformer:
        """The model a run of ``cfg`` trains (or its pipeline stage ``part``), on the current default device: the
        Trainer's, and the simulation's and the plan's, which must follow it."""
        return cls(
            cfg.model,
            cfg.data.vocab_size,
            tp,
            rng,
            seed=cfg.train.seed,
            sequence_parallel=cfg.parallel.sequence_parallel,
            vocab_multiple=cfg.parallel.vocab_multiple,
            pad_to_multiple=cfg.parallel.pad_to_multiple,
            part=part,
        )

    def __init__(
        self,
        cfg: ModelConfig,
        vocab_size: int,
        tp: TPGroup,
        rng: DropoutRNG,
        *,
        seed: int = 1,
        sequence_parallel: bool = False,
        vocab_multiple: int = 128,
        pad_to_multiple: int = 1,
        pad_id: int = PAD_ID,
        part: StagePart | None = None,
    ) -> None:
        super().__init__()
        check_model_split(cfg, tp.size)
        self.cfg = cfg
        self.tp = tp
        self.rng = rng
        self.vocab_size = vocab_size
        self.pad_id = pad_id
        self.sequence_parallel = sequence_parallel and tp.size > 1
        # Training lengths are padded to a multiple of this (parallel.pad_to_multiple; under sequence
        # parallelism also of tp, so that every TP rank holds an equal part of each sequence).
        self.length_multiple = math.lcm(pad_to_multiple, tp.size if self.sequence_parallel else 1)
        self.part = part = part or StagePart.whole(cfg)
        sp = self.sequence_parallel
        if part.embedding:
            self.embed = VocabParallelEmbedding(
                padded_vocab_size(vocab_size, tp.size, vocab_multiple), cfg.d_model, tp, pad_id, sp, vocab_size
            )
        self.register_buffer("positions", sinusoidal_positions(cfg.max_positions, cfg.d_model), persistent=False)
        self.embed_dropout = Dropout(cfg.dropout, rng, split_dim=SEQ_DIM if sp else None)
        self.encoder = _layer_stack(part.encoder, lambda: EncoderLayer(cfg, tp, rng, sp))
        self.decoder = _layer_stack(part.decoder, lambda: DecoderLayer(cfg, tp, rng, sp))
        # Pre-LN needs a final LayerNorm on each stack; post-LN layers already end with one.
        pre = cfg.norm == "pre"
        norm = lambda: LayerNorm(cfg.d_model, tp, cfg.layernorm_eps, sp)  # noqa: E731
        self.encoder_norm = norm() if pre and part.ends_encoder else nn.Identity()
        self.decoder_norm = norm() if pre and part.last else nn.Identity()
        self.activation_checkpointing = cfg.activation_checkpointing
        self._compiled: dict[nn.Module, nn.Module] = {}  # layer -> its compiled forward (compile_layers)
        init_parameters(self, seed, tp)
        if part.embedding == COPY:
            # A pipeline stage other than the first uses the table but does not own it: a
            # plain tensor that the pipeline refreshes from the owner after every step.
            weight = self.embed.weight.detach()
            del self.embed.weight
            self.embed.register_buffer("weight", weight, persistent=False)

    # ---- building blocks ------------------------------------------------------------------

    def embed_tokens(self, ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """sqrt(d_model) * E[ids] + PE, then dropout; (batch, len, d) or this rank's part of len."""
        length = ids.shape[1]
        if length + offset > self.positions.shape[0]:
            raise ValueError(
                f"sequence of {length + offset} tokens is longer than model.max_positions={self.positions.shape[0]}"
            )
        x = self.embed(ids) * math.sqrt(self.cfg.d_model)
        start = offset + (self.tp.rank * x.shape[1] if self.sequence_parallel else 0)
        x = x + self.positions[start : start + x.shape[1]].to(x.dtype)
        return self.embed_dropout(x)

    def compile_layers(self) -> None:
        """Train each encoder and decoder layer through ``torch.compile`` (``train.compile``).

        Regional compilation, as torchtitan does it: one graph per layer class, reused by
        every layer of that class, with dynamic batch and length (one compilation, not one
        per bucket shape). Only training forwards run compiled; decoding and validation
        run the same modules eagerly. The layers' dropout keys arrive as tensors
        (:meth:`DropoutRNG.region`), so the masks are the eager ones.
        """
        self._compiled = {layer: torch.compile(layer, dynamic=True) for layer in self.layers()}

    def layers(self) -> list[nn.Module]:
        """This model's (or stage's) encoder and decoder layers, in order."""
        return [layer for stack in (self.encoder, self.decoder) for layer in stack.children()]

    def _layer(self, layer: nn.Module, *args) -> torch.Tensor:
        if not self.training:
            return layer(*args)
        forward = self._compiled.get(layer, layer)
        if forward is not layer and any(
            isinstance(a, torch.Tensor) and a.dim() == 3 and 1 in a.shape[:2] for a in args
        ):
            # A batch or a length of 1 (an odd last micro-batch) breaks the compiled graph's
            # guards (Dynamo specializes sizes 0 and 1) and would compile the layer again,
            # ~20 s; the eager layer computes the same.
            forward = layer
        if forward is not layer:
            _sizes_of_their_own(args)

        def run(*inputs: torch.Tensor) -> torch.Tensor:
            # a compiled layer reads its dropout keys as tensors; an eager one as integers
            with self.rng.region(layer.mask_draws(), inputs[0].device if forward is not layer else None):
                return forward(*inputs)

        if self.activation_checkpointing and torch.is_grad_enabled():
            return checkpoint_with_rng(run, self.rng, *args)
        return run(*args)

    def source_mask(self, src: torch.Tensor) -> torch.Tensor:
        """(batch, 1, 1, src_len) True where a key is a real token.

        Always a mask, also when nothing is padded: asking whether anything is would copy
        a flag to the host and wait for the GPU every micro-batch. An all-True mask gives
        the same attention (tests/test_model.py checks it bitwise on the CPU).
        """
        return src.ne(self.pad_id)[:, None, None, :]

    def encode(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder output (batch, src_len, d) and the source key mask."""
        mask = self.source_mask(src)
        x = self.embed_tokens(src)
        for layer in self.encoder:
            x = self._layer(layer, x, mask)
        return self.encoder_norm(x), mask

    def decode(
        self,
        tgt_in: torch.Tensor,
        memory: torch.Tensor,
        memory_mask: torch.Tensor | None,
        cache: DecoderCache | None = None,
    ) -> torch.Tensor:
        """Decoder hidden states for ``tgt_in``; with ``cache``, ``tgt_in`` holds only new positions."""
        offset = cache.length if cache is not None else 0
        x = self.embed_tokens(tgt_in, offset)
        for i, layer in enumerate(self.decoder):
            if cache is not None:
                x = layer(x, memory, memory_mask, cache.self_attn[i], cache.cross_attn[i])
            else:
                x = self._layer(layer, x, memory, memory_mask)
        return self.decoder_norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the logits, (batch, len, padded_vocab / tp)."""
        return self.embed.logits(hidden)

    # ---- training ---------------------------------------------------------------------------

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel logits (batch, tgt_len, padded_vocab / tp) of teacher-forced decoding."""
        memory, mask = self.encode(src)
        return self.logits(self.decode(tgt_in, memory, mask))

    def pad_lengths(self, *ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``ids`` with their lengths padded to :attr:`length_multiple`, as training and validation feed them."""
        return tuple(pad_to_multiple(t, self.length_multiple, self.pad_id) for t in ids)

    def loss(
        self,
        src: torch.Tensor,
        tgt_in: torch.Tensor,
        tgt_out: torch.Tensor,
        label_smoothing: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed label-smoothed cross-entropy over the target tokens, and their count.

        Both are 0-dim tensors on the model's device: reading the count on the host (``int``)
        waits for the GPU, so that is left to callers that need it (the trainer counts the
        tokens of a batch on the host when it collates it).
        """
        src, tgt_in, tgt_out = self.pad_lengths(src, tgt_in, tgt_out)
        logits = self(src, tgt_in)
        per_token = vocab_parallel_cross_entropy(
            logits.flatten(0, 1), tgt_out.flatten(), self.tp, self.vocab_size, label_smoothing, self.pad_id
        )
        return per_token.sum(), tgt_out.ne(self.pad_id).sum()


def _layer_stack(indices: range, make) -> nn.Module:
    """The layers ``indices`` of a stack, named by their index in the whole model (``encoder.3.*`` on any stage).

    The whole stack is a ``ModuleList``; a pipeline stage's part of it a ``ModuleDict``
    keyed by the layer numbers, so that parameter names never depend on the pipeline cut.
    """
    if indices.start == 0:
        return nn.ModuleList(make() for _ in indices)
    return nn.ModuleDict({str(i): make() for i in indices})


def checkpoint_with_rng(layer: Callable[..., torch.Tensor], rng: DropoutRNG, *args) -> torch.Tensor:
    """Run ``layer`` without keeping activations; backward recomputes it with the same dropout masks.

    The recomputation draws from a fork of the dropout streams as they were before the
    forward, so the streams stay where the original forward left them.
    """
    start = rng.state_dict()

    @contextmanager
    def recompute():
        with rng.fork(copy.deepcopy(start)):
            yield

    return checkpoint(layer, *args, use_reentrant=False, context_fn=lambda: (nullcontext(), recompute()))
