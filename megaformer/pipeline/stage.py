"""One pipeline stage's forward: what it receives, computes and sends for one micro-batch.

A stage is a :class:`megaformer.model.Transformer` built with a :class:`StagePart`:
the same parameter names as the whole model, only its own layers. Every stage reads
the micro-batch itself (the ids are the replica's data stream, equal on its stages),
so the source mask and every tensor shape are known locally: no shapes travel and
nothing is padded beyond what the batch already is. Between stages travel, in this
order and only where the next stage needs them, the encoder's hidden states, the
encoder output (``memory``: every decoder stage attends to it, so it is passed along
the decoder stages and its gradient summed back along them) and the decoder's hidden
states.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megaformer.model import Transformer
from megaformer.parallel import vocab_parallel_cross_entropy
from megaformer.parallel.stages import StagePart


@dataclass
class StageBatch:
    """A micro-batch's ids as a stage uses them (lengths padded for sequence parallelism)."""

    src: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor

    @classmethod
    def of(cls, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor, model: Transformer) -> StageBatch:
        return cls(*model.pad_lengths(src, tgt_in, tgt_out))


def input_shapes(part: StagePart, batch: StageBatch, model: Transformer) -> list[tuple[int, ...]]:
    """Shapes of the tensors ``part`` receives for ``batch``, in message order (this TP rank's part)."""
    split = model.tp.size if model.sequence_parallel else 1
    d = model.cfg.d_model
    source = (batch.src.shape[0], batch.src.shape[1] // split, d)
    target = (batch.tgt_in.shape[0], batch.tgt_in.shape[1] // split, d)
    return message(part, source, source, target)


def message(receiver: StagePart, encoder, memory, decoder) -> list:
    """Of the encoder states, the encoder output and the decoder states, those ``receiver`` needs, in order."""
    needs = (receiver.receives_encoder, receiver.receives_memory, receiver.receives_decoder)
    return [item for item, needed in zip((encoder, memory, decoder), needs, strict=True) if needed]


def stage_forward(
    model: Transformer, inputs: list[torch.Tensor], batch: StageBatch, next_part: StagePart | None, smoothing: float
) -> list[torch.Tensor] | tuple[torch.Tensor, torch.Tensor]:
    """This stage's layers on one micro-batch.

    Returns the tensors for ``next_part`` (in message order), or on the last stage the
    summed label-smoothed loss and the target token count (0-dim, on the device).
    """
    out = stage_outputs(model, inputs, batch, next_part)
    if next_part is not None:
        return out
    per_token = vocab_parallel_cross_entropy(
        out.flatten(0, 1), batch.tgt_out.flatten(), model.tp, model.vocab_size, smoothing, model.pad_id
    )
    return per_token.sum(), batch.tgt_out.ne(model.pad_id).sum()


def stage_outputs(
    model: Transformer, inputs: list[torch.Tensor], batch: StageBatch, next_part: StagePart | None
) -> list[torch.Tensor] | torch.Tensor:
    """The tensors for ``next_part`` (in message order), or on the last stage this TP rank's slice of the logits."""
    part: StagePart = model.part
    received = iter(inputs)
    mask = model.source_mask(batch.src)
    x = memory = y = None
    if part.encoder:
        x = model.embed_tokens(batch.src) if part.embeds_source else next(received)
        for layer in model.encoder.children():
            x = model._layer(layer, x, mask)
        if part.ends_encoder:
            memory = model.encoder_norm(x)
    if part.receives_memory:
        memory = next(received)
    if part.decoder:
        y = model.embed_tokens(batch.tgt_in) if part.embeds_target else next(received)
        for layer in model.decoder.children():
            y = model._layer(layer, y, memory, mask)
    if next_part is None:
        return model.logits(model.decoder_norm(y))
    return message(next_part, x, memory, y)


def mask_draws(model: Transformer) -> dict[str, int]:
    """Dropout masks this stage draws from each stream per training micro-batch.

    Each layer counts its own dropout calls (:meth:`EncoderLayer.mask_draws`); the
    embedding dropout runs once per embedding the stage performs (source and target
    share the module). The pipeline adds up the stages before this one to
    know where in a micro-batch's masks this stage starts.
    """
    part: StagePart = model.part
    counts = {"shared": 0, "local": 0}

    def add(draws: dict[str, int], times: int = 1) -> None:
        for k, v in draws.items():
            counts[k] += v * times

    add(model.embed_dropout.mask_draws(), int(part.embeds_source) + int(part.embeds_target))
    for layer in model.layers():
        add(layer.mask_draws())
    return counts
