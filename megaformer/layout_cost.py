"""A stated estimate of one optimizer step's time per layout: compute vs TP and DP communication.

Per GPU and optimizer step, with ``T = train.tokens_per_step`` tokens per side, ``P``
parameters (``P_t`` on one TP rank), ``h = d_model``, world ``W = tp x dp``:

* compute: ``6 P T / W`` FLOP at ``efficiency x peak`` (dense bf16 tensor-core peak);
* TP (NVLink, on the critical path): each TP rank sees all ``T / dp`` tokens of its DP
  rank; every sublayer ends with an all-reduce of ``(T / dp) x h`` activations in
  forward and its conjugate in backward (encoder layer 2 + 2, decoder layer 3 + 3, the
  two vocab-parallel embeddings 1 each, the output projection's input 1 in backward;
  activation checkpointing repeats the forward ones). A ring all-reduce moves
  ``2 (tp - 1) / tp`` times the tensor through each GPU. Sequence parallelism swaps
  each all-reduce for a reduce-scatter + all-gather: the same bytes.
* DP (once per step, after backward): the gradients ``P_t x 4`` bytes (fp32 reduction;
  fp16 reduces in fp16) are all-reduced (ZeRO-1/2: reduce-scatter + all-gather, the
  same volume). Rank order puts TP innermost, so a DP group has ``l = 8 / tp`` members
  in each of its ``n`` nodes (one node: all of them). NCCL reduces hierarchically over
  the node's rails: ``2 (l - 1) / l x G`` over NVLink, then ``2 (n - 1) / n x G / l``
  over each GPU's own NIC. Note what follows: the inter-node bytes per NIC do *not*
  shrink with TP (``P_t / l = P / 8`` for every tp); TP only moves the node-internal
  share of the reduction from gradients to activations.

Nothing is assumed to overlap, and narrow GEMMs are not penalised (TP=8 leaves 2 heads
and d_ff / 8 per GPU, which runs below ``efficiency``): treat the estimate as a
ranking between layouts, not a prediction of tokens/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megaformer.config import ModelConfig


@dataclass(frozen=True)
class Hardware:
    """The machine the estimate assumes (an 8-GPU H100/H200 node, rail-optimised 400 Gb/s fabric)."""

    gpus_per_node: int = 8
    peak_tflops: float = 989.0  # dense bf16 tensor-core peak per GPU (H100/H200 SXM)
    efficiency: float = 0.4  # fraction of the peak the model's GEMMs reach (assumed)
    nvlink_gbs: float = 360.0  # NCCL all-reduce bus bandwidth inside a node (NVLink 4: 450 GB/s each way)
    nic_gbs: float = 45.0  # inter-node bandwidth per GPU (one 400 Gb/s NIC per GPU at ~90 %)


def tp_all_reduces(model: ModelConfig) -> int:
    """All-reduces (or reduce-scatter + all-gather pairs) of a (tokens, d_model) tensor per micro-batch pass."""
    forward = 2 * model.encoder_layers + 3 * model.decoder_layers + 2
    backward = 2 * model.encoder_layers + 3 * model.decoder_layers + 1
    recompute = 2 * model.encoder_layers + 3 * model.decoder_layers if model.activation_checkpointing else 0
    return forward + backward + recompute


def step_cost(
    model: ModelConfig,
    parameters: int,
    parameters_per_rank: int,
    tokens_per_step: int,
    tp: int,
    dp: int,
    precision: str,
    hw: Hardware = Hardware(),
) -> dict:
    """Seconds and bytes per GPU of one optimizer step at ``tp x dp`` (see the module docstring)."""
    world = tp * dp
    compute_flop = 6 * parameters * tokens_per_step / world
    compute_s = compute_flop / (hw.peak_tflops * 1e12 * hw.efficiency)
    act_bytes = 4 if precision == "fp32" else 2
    tp_bytes = tp_all_reduces(model) * 2 * (tp - 1) / tp * (tokens_per_step / dp) * model.d_model * act_bytes
    grads = parameters_per_rank * (2 if precision == "fp16" else 4)
    nodes = max(1, math.ceil(world / hw.gpus_per_node))
    local = max(1, dp // nodes)
    dp_nvlink_bytes = 2 * (local - 1) / local * grads
    dp_nic_bytes = 2 * (nodes - 1) / nodes * grads / local
    tp_s = tp_bytes / (hw.nvlink_gbs * 1e9)
    dp_s = dp_nvlink_bytes / (hw.nvlink_gbs * 1e9) + dp_nic_bytes / (hw.nic_gbs * 1e9)
    return {
        "tp": tp,
        "dp": dp,
        "nodes": nodes,
        "compute_flop": compute_flop,
        "compute_s": compute_s,
        "tp_bytes": tp_bytes,
        "tp_s": tp_s,
        "dp_nvlink_bytes": dp_nvlink_bytes,
        "dp_nic_bytes": dp_nic_bytes,
        "dp_s": dp_s,
        "step_s": compute_s + tp_s + dp_s,
    }
