"""A layout's memory per GPU and step time, summed from traced pieces: no model built per layout.

:func:`megaformer.plan.trace.trace_layers` gives, at one TP size, checkpointing choice and
micro-batch shape, three traces whose differences are the :class:`Piece` of one encoder layer,
one decoder layer and the rest (embeddings, output projection, loss). A pipeline stage is a sum of
pieces (the rest's weights on the first stage, its work and activations on the last: the output
projection and the loss outweigh the embedding lookups); DeepSpeed's share is
:mod:`megaformer.plan.deepspeed`. Per rank of the stage that needs the most:

* **memory** = weights + the engine's state + gradients kept between micro-batches (two or more of
  them) + the activations of the micro-batches 1F1B keeps in flight (``min(pp - s, m)`` on stage s)
  + one micro-batch's own peak (its temporaries, and its gradients as they appear);
* **step** = ``(m + pp - 1)`` x the slowest stage's micro-batch (its operators priced on the GPU's
  roofline with the host dispatching beside it, :mod:`megaformer.sim.roofline`, plus its TP
  collectives on the node's links, which nothing overlaps) + the transfers between stages at every
  micro-batch, forward and backward + the data-parallel collectives after the last backward (ZeRO-2's
  reductions of the earlier micro-batches overlap the next micro-batch's work; nothing else
  overlaps) + Adam's pass over the rank's shard at the memory bandwidth.

A ring collective over ``n`` ranks moves ``2 (n - 1) / n`` x the tensor through each rank (all-reduce),
``(n - 1) / n`` (reduce-scatter of the whole input, all-gather of n shards), plus ``latency`` each.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from megaformer.plan.record import Collective
from megaformer.plan.trace import Trace
from megaformer.sim.roofline import Device, timeline


@dataclass(frozen=True)
class Cluster:
    """The machines: ``nodes`` x ``gpus_per_node`` GPUs, links in bytes/s per GPU and direction."""

    nodes: int
    gpus_per_node: int
    device: Device
    memory_bytes: float
    intra_bps: float  # NVLink
    inter_bps: float  # the GPU's share of the node's network
    latency_s: float = 10e-6  # per collective or transfer
    usable: float = 0.9  # of the memory: the rest for the allocator's caching, CUDA and NCCL

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class Piece:
    """Part of a model's micro-batch: seconds, collectives (op, group) -> [count, bytes], memory in bytes."""

    seconds: float = 0.0
    weights: float = 0.0
    params: float = 0.0
    peak: float = 0.0
    grads: float = 0.0
    collectives: Counter = field(default_factory=Counter)  # (op, group, "count" | "bytes") -> n
    device: float = 0.0  # of ``seconds``, the device's busy time (the rest the device waits on its host)

    def plus(self, other: Piece, times: float = 1.0) -> Piece:
        c = Counter(self.collectives)
        for key, value in other.collectives.items():
            c[key] += times * value
        return Piece(
            self.seconds + times * other.seconds,
            self.weights + times * other.weights,
            self.params + times * other.params,
            self.peak + times * other.peak,
            self.grads + times * other.grads,
            c,
            self.device + times * other.device,
        )

    @property
    def activations(self) -> float:
        return self.peak - self.grads


def piece_of(trace: Trace, device: Device) -> Piece:
    c = Counter()
    for call in trace.collectives:
        c[(call.op, call.group, "count")] += 1
        c[(call.op, call.group, "bytes")] += call.bytes
    cost = timeline(trace.ops, device)
    return Piece(cost.seconds, trace.weights, trace.params, trace.peak, trace.grads, c, cost.device_seconds)


def pieces(traces: tuple[Trace, Trace, Trace], device: Device) -> tuple[Piece, Piece, Piece]:
    """(rest, encoder layer, decoder layer) from the (1, 1), (2, 1), (1, 2)-layer traces."""
    one, two_enc, two_dec = (piece_of(t, device) for t in traces)
    enc, dec = two_enc.plus(one, -1), two_dec.plus(one, -1)
    return one.plus(enc, -1).plus(dec, -1), enc, dec


def ring_seconds(call: Collective, size: int, bps: float, latency: float) -> float:
    if size <= 1:
        return 0.0
    share = {"all_reduce": 2 * (size - 1) / size, "reduce_scatter": (size - 1) / size}.get(call.op)
    moved = call.bytes * (share if share is not None else (size - 1 if call.op == "all_gather" else 1))
    return latency + moved / bps


def stage_piece(rest: Piece, enc: Piece, dec: Piece, encoder: int, decoder: int, first: bool, last: bool) -> Piece:
    """A stage of ``encoder`` + ``decoder`` layers: the rest's weights on the first stage, its work on the last."""
    piece = Piece().plus(enc, encoder).plus(dec, decoder)
    if first:
        piece = piece.plus(Piece(weights=rest.weights, params=rest.params, grads=rest.grads))
    if last:
        peak = rest.peak - (rest.grads if first else 0)
        work = Piece(rest.seconds, peak=peak, collectives=rest.collectives, device=rest.device)
        piece = piece.plus(work)
    return piece


def tp_seconds(piece: Piece, tp: int, cluster: Cluster) -> float:
    """The TP collectives of one micro-batch of ``piece`` on the node's links."""
    total = 0.0
    for (op, group, what), n in piece.collectives.items():
        if group == "tp" and what == "count" and n > 0:
            size = piece.collectives[(op, group, "bytes")] / n
            total += n * ring_seconds(Collective(op, group, int(size)), tp, cluster.intra_bps, cluster.latency_s)
    return total


def checkpointed(parts: tuple[Piece, Piece, Piece], layer_input: float) -> tuple[Piece, Piece, Piece]:
    """The pieces with activation checkpointing, from those without (torch's checkpoint refuses to recompute under
    the recorders): a layer keeps only its input (``layer_input`` bytes), recomputes its forward (a third of its
    forward and backward), and one layer's activations live again during its backward."""
    rest, enc, dec = parts
    layers = []
    for layer in (enc, dec):
        kept = Piece(weights=layer.weights, params=layer.params, grads=layer.grads, collectives=layer.collectives)
        again = Piece(seconds=layer.seconds * 4 / 3, peak=layer.grads + layer_input, device=layer.device * 4 / 3)
        layers.append(kept.plus(again))
    again = max(enc.activations, dec.activations)
    return rest.plus(Piece(peak=again)), layers[0], layers[1]
