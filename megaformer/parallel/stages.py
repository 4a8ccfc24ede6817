"""Which layers each pipeline stage holds: pure arithmetic, checked before any process group.

The encoder's layers, then the decoder's, are cut into ``pp`` contiguous stages. A
stage may hold the end of the encoder and the start of the decoder. The shared
vocab-parallel embedding lives on the first stage (encoder input); the stage that
starts the decoder (decoder input) and the last stage (output projection) hold a copy
when they are other stages (see :mod:`megaformer.pipeline.schedule` for how the copies
stay equal).

Without ``parallel.pp_split`` the cut minimises the most expensive stage, from the
matmul work per token of each piece: an encoder layer ``4 d^2 + 2 d d_ff``, a
decoder layer ``8 d^2 + 2 d d_ff`` (its cross-attention projects the source too,
about 1.5 encoder layers at the paper's shapes) and the output projection and loss
``d x vocab`` on the last stage, which at the paper's vocabulary weighs as much as
several encoder layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megaformer.config import ModelConfig, stage_layer_counts

OWN, COPY = "own", "copy"  # how a stage holds the shared embedding


@dataclass(frozen=True)
class StagePart:
    """The layers of one stage: encoder and decoder layer indices, and how it holds the embedding."""

    index: int
    stages: int
    encoder: range
    decoder: range
    encoder_layers: int
    decoder_layers: int

    @classmethod
    def whole(cls, model: ModelConfig) -> StagePart:
        return cls(
            0, 1, range(model.encoder_layers), range(model.decoder_layers), model.encoder_layers, model.decoder_layers
        )

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.stages - 1

    @property
    def embeds_source(self) -> bool:
        return 0 in self.encoder

    @property
    def ends_encoder(self) -> bool:
        return self.encoder_layers - 1 in self.encoder

    @property
    def embeds_target(self) -> bool:
        return 0 in self.decoder

    @property
    def embedding(self) -> str | None:
        """``own`` (the first stage: the optimizer's copy), ``copy`` (another user of the table) or None."""
        if self.first:
            return OWN
        return COPY if self.embeds_target or self.last else None

    @property
    def receives_encoder(self) -> bool:
        """The stage's input holds the encoder's hidden states (it starts inside the encoder)."""
        return not self.first and bool(self.encoder) and not self.embeds_source

    @property
    def receives_memory(self) -> bool:
        """The stage's input holds the encoder output (it holds decoder layers and no end of the encoder)."""
        return bool(self.decoder) and not self.ends_encoder

    @property
    def receives_decoder(self) -> bool:
        """The stage's input holds the decoder's hidden states (it starts inside the decoder)."""
        return bool(self.decoder) and not self.embeds_target

    def describe(self) -> str:
        parts = []
        if self.encoder:
            parts.append(_span("encoder", self.encoder))
        if self.decoder:
            parts.append(_span("decoder", self.decoder))
        return " + ".join(parts)


def _span(name: str, layers: range) -> str:
    return f"{name} {layers.start}" if len(layers) == 1 else f"{name} {layers.start}-{layers.stop - 1}"


def layer_costs(model: ModelConfig, vocab_size: int) -> tuple[float, float, float]:
    """Matmul work per token of an encoder layer, a decoder layer and the output projection with its loss."""
    d, f = model.d_model, model.d_ff
    return 4 * d * d + 2 * d * f, 8 * d * d + 2 * d * f, float(d * vocab_size)


def balanced_split(model: ModelConfig, pp: int, vocab_size: int) -> list[int]:
    """Layers per stage that minimise the most expensive stage (contiguous cut, at least one layer each).

    ``best[k][i]``, the smallest maximum stage cost cutting the first ``i`` layers into
    ``k`` stages, is the minimum over ``j`` of ``max(best[k-1][j], cost(j, i))``: the first
    term grows with ``j`` (costs are positive), the second falls. The minimum is at their
    crossing, the first ``j`` with ``best[k-1][j] + prefix[j] >= prefix[i] (+ head)``, or
    at the ``j`` just before it: one binary search per ``(k, i)``, all ``i`` of a ``k`` at
    once, instead of a scan over ``j`` (4,000 layers in 2,000 stages take a second, not
    hours). Ties go to the smaller ``j``, as the scan in increasing ``j`` gave them.
    """
    enc, dec, head = layer_costs(model, vocab_size)
    n = model.encoder_layers + model.decoder_layers
    prefix = [0.0]
    for c in [enc] * model.encoder_layers + [dec] * model.decoder_layers:
        prefix.append(prefix[-1] + c)
    prefix = np.array(prefix)
    previous = np.full(n + 1, np.inf)  # best[k-1][j]; best[0][j] = inf for j > 0: no stage would hold them
    previous[0] = 0.0
    cuts = []  # cuts[k-1][i - k]: where stage k starts when the first i layers are cut into k stages
    for k in range(1, pp + 1):
        extra, lo, top = (head if k == pp else 0.0), k - 1, n - (pp - k)  # stage k ends at i in [k, top]
        i = np.arange(k, top + 1)
        rising = previous[lo:top] + prefix[lo:top]  # nondecreasing in j
        j = np.minimum(lo + np.searchsorted(rising, prefix[i] + extra, side="left"), i)  # i: no crossing
        own_cost_before = prefix[i] - prefix[np.maximum(j - 1, 0)] + extra
        j = j - ((j == i) | ((j > lo) & (own_cost_before <= previous[np.minimum(j, n)])))
        current = np.full(n + 1, np.inf)
        current[i] = np.maximum(previous[j], prefix[i] - prefix[j] + extra)
        previous = current
        cuts.append(j)
    counts, end = [], n
    for k in range(pp, 0, -1):
        start = int(cuts[k - 1][end - k])
        counts.append(end - start)
        end = start
    return counts[::-1]


def plan_stages(model: ModelConfig, pp: int, split: str = "", vocab_size: int = 8000) -> list[StagePart]:
    """The :class:`StagePart` of each of ``pp`` stages; refuses a layout that cannot be cut, saying what to change."""
    counts = stage_layer_counts(model, pp, split) or balanced_split(model, pp, vocab_size)
    parts, start = [], 0
    for index, count in enumerate(counts):
        stop = start + count
        encoder = range(min(start, model.encoder_layers), min(stop, model.encoder_layers))
        decoder = range(max(start - model.encoder_layers, 0), max(stop - model.encoder_layers, 0))
        parts.append(StagePart(index, pp, encoder, decoder, model.encoder_layers, model.decoder_layers))
        start = stop
    return parts


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """The idle share of a 1F1B step with equal stages: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)
