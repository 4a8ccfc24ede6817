"""The exact mapping of megaformer's Transformer onto Hugging Face ``MarianMTModel``.

Both are the paper's model: post-LN layers, biases on every projection, one shared
embedding table scaled by sqrt(d_model) that is also the output projection, fixed
sinusoidal positions from 0, ReLU. What differs, and how it is mapped exactly:

* **Positions.** megaformer interleaves them, PE[p, 2i] = sin(p w_i), PE[p, 2i+1] = cos(p w_i);
  Marian (``MarianSinusoidalPositionalEmbedding``, recomputed, not stored) puts the sines in
  the first half and the cosines in the second: PE'[p, i] = sin(p w_i), PE'[p, d/2 + i] = cos(p w_i),
  with the same w_i = 10000^(-2i/d). With the permutation P of the d_model basis that sends
  coordinate 2i to i and 2i+1 to d/2 + i, PE' = PE P. Every residual-stream vector of
  megaformer, x, is mapped to x P: the embedding table's columns, the input columns of every
  projection that reads the stream (Q, K, V, the FFN's first layer), the output rows and bias
  of every projection that writes it (attention outputs, the FFN's second layer), and the
  LayerNorm scales and shifts. LayerNorm commutes with a permutation (mean and variance do not
  depend on order), attention and FFN inner dimensions are untouched, and the tied output
  projection gives (x P)(E P)^T = x E^T: the logits are the same numbers, not approximations.
* **Fused projections.** megaformer's QKV (self-attention) and KV (cross-attention) are row
  blocks [Q; K; V] of whole heads in order; Marian's ``q_proj``, ``k_proj``, ``v_proj`` are
  those blocks.
* **Vocabulary.** megaformer pads its table to a multiple of 128 rows that never get
  probability; Marian gets the real vocabulary's rows only, and ``final_logits_bias`` = 0.
* **Decoding.** megaformer's decoder starts from bos (id 2) and never outputs pad or bos:
  ``decoder_start_token_id`` = 2 and ``bad_words_ids`` = [[0], [2]]. Marian's own models start
  from pad, which is only a convention of the config.
* **Tokenizer.** ``MarianTokenizer`` maps sentencepiece pieces through ``vocab.json`` and
  appends ``</s>``, as megaformer encodes (pieces + eos): ``vocab.json`` is the sentencepiece
  model's own id of every piece, ``source.spm`` = ``target.spm`` = the model.

Refused, with the reason: pre-LN (Marian is post-LN only, and the final LayerNorm of a pre-LN
stack has no place; CTranslate2's Transformer has both, so its export takes a pre-LN model's
layers through this mapping and the final LayerNorms from :func:`final_norm_state`), a LayerNorm
epsilon other than 1e-5 (Marian's ``nn.LayerNorm`` default is not configurable), an odd d_model,
no tokenizer, special pieces other than <pad> <unk> <s> </s> at ids 0 1 2 3, and any parameter
the mapping does not know.
"""

from __future__ import annotations

import torch

from megaformer.checkpoint import Consolidated
from megaformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from megaformer.export import ExportError

SPECIAL_PIECES = {PAD_ID: "<pad>", UNK_ID: "<unk>", BOS_ID: "<s>", EOS_ID: "</s>"}
MARIAN_LAYERNORM_EPS = 1e-5

# (megaformer suffix, Marian suffixes it is cut into along dim 0, dimension that carries d_model or None)
_ATTENTION = [
    ("out.weight", ("out_proj.weight",), 0),
    ("out.bias", ("out_proj.bias",), 0),
]
_SELF_ATTENTION = [
    ("qkv.weight", ("q_proj.weight", "k_proj.weight", "v_proj.weight"), 1),
    ("qkv.bias", ("q_proj.bias", "k_proj.bias", "v_proj.bias"), None),
    *_ATTENTION,
]
_CROSS_ATTENTION = [
    ("q.weight", ("q_proj.weight",), 1),
    ("q.bias", ("q_proj.bias",), None),
    ("kv.weight", ("k_proj.weight", "v_proj.weight"), 1),
    ("kv.bias", ("k_proj.bias", "v_proj.bias"), None),
    *_ATTENTION,
]
_FFN = [
    ("ffn.fc1.weight", ("fc1.weight",), 1),
    ("ffn.fc1.bias", ("fc1.bias",), None),
    ("ffn.fc2.weight", ("fc2.weight",), 0),
    ("ffn.fc2.bias", ("fc2.bias",), 0),
]

FINAL_NORMS = tuple(  # a pre-LN model's final LayerNorm of each stack, which Marian has no place for
    f"{stack}_norm.{p}" for stack in ("encoder", "decoder") for p in ("weight", "bias")
)


def _norm(ours: str, theirs: str) -> list[tuple[str, tuple[str, ...], int]]:
    return [(f"{ours}.{p}", (f"{theirs}.{p}",), 0) for p in ("weight", "bias")]


def _prefixed(entries, ours: str, theirs: str) -> list[tuple[str, tuple[str, ...], int | None]]:
    return [(ours + a, tuple(theirs + x for x in b), dim) for a, b, dim in entries]


def name_map(encoder_layers: int, decoder_layers: int) -> list[tuple[str, tuple[str, ...], int | None]]:
    """Every megaformer parameter but the embedding: (name, Marian names, permuted dimension)."""
    out = []
    for i in range(encoder_layers):
        ours, theirs = f"encoder.{i}.", f"model.encoder.layers.{i}."
        out += _prefixed(_SELF_ATTENTION, ours + "self_attn.", theirs + "self_attn.")
        out += _prefixed(_FFN, ours, theirs)
        out += _prefixed(_norm("norm1", "self_attn_layer_norm") + _norm("norm2", "final_layer_norm"), ours, theirs)
    for i in range(decoder_layers):
        ours, theirs = f"decoder.{i}.", f"model.decoder.layers.{i}."
        out += _prefixed(_SELF_ATTENTION, ours + "self_attn.", theirs + "self_attn.")
        out += _prefixed(_CROSS_ATTENTION, ours + "cross_attn.", theirs + "encoder_attn.")
        out += _prefixed(_FFN, ours, theirs)
        norms = _norm("norm1", "self_attn_layer_norm") + _norm("norm2", "encoder_attn_layer_norm")
        out += _prefixed(norms + _norm("norm3", "final_layer_norm"), ours, theirs)
    return out


def basis_permutation(d_model: int) -> torch.Tensor:
    """P as an index: Marian coordinate j holds megaformer coordinate perm[j] = (0, 2, 4, ..., 1, 3, 5, ...)."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def check_marian(model: Consolidated, *, final_norms: bool = False) -> None:
    """Refuse, in one line, what Marian cannot express exactly (see the module docstring).

    ``final_norms``: the target also has pre-LN layers and a final LayerNorm per stack (CTranslate2).
    """
    m = model.config.model
    reasons = []
    if m.norm == "pre" and not final_norms:
        reasons.append(
            f"model.norm={m.norm!r}: Marian has post-LN layers only and no final LayerNorm per stack "
            f"(--format ct2 takes pre-LN models)"
        )
    if m.layernorm_eps != MARIAN_LAYERNORM_EPS:
        reasons.append(f"model.layernorm_eps={m.layernorm_eps}: Marian's LayerNorm epsilon is fixed at 1e-5")
    if m.d_model % 2:
        reasons.append(f"model.d_model={m.d_model} is odd: the sin|cos halves of Marian's positions need it even")
    expected = {"embed.weight"} | {name for name, _, _ in name_map(m.encoder_layers, m.decoder_layers)}
    if m.norm == "pre":
        expected |= set(FINAL_NORMS)
    unknown = sorted(set(model.model) - expected) + sorted(expected - set(model.model))
    if unknown:
        reasons.append(f"parameters {unknown[:3]} have no Marian counterpart or are missing")
    if reasons:
        raise ExportError("cannot export to Marian exactly: " + "; ".join(reasons))


def to_marian_state(model: Consolidated, *, final_norms: bool = False) -> dict[str, torch.Tensor]:
    """Marian's state dict (every tied name, ``final_logits_bias``) from megaformer's TP=1 parameters.

    ``final_norms``: a pre-LN model's layers are mapped too, without the final LayerNorm of each
    stack (:func:`final_norm_state`): those weights alone are not the model.
    """
    check_marian(model, final_norms=final_norms)
    m = model.config.model
    perm = basis_permutation(m.d_model)
    table = model.model["embed.weight"][: model.vocab_size].index_select(1, perm).contiguous()
    state = {name: table for name in _TABLE_NAMES}
    state["final_logits_bias"] = torch.zeros(1, model.vocab_size, dtype=table.dtype)
    for ours, theirs, dim in name_map(m.encoder_layers, m.decoder_layers):
        for name, part in zip(theirs, model.model[ours].chunk(len(theirs), dim=0)):
            state[name] = (part if dim is None else part.index_select(dim, perm)).contiguous()
    return state


_TABLE_NAMES = (
    "model.shared.weight",
    "model.encoder.embed_tokens.weight",
    "model.decoder.embed_tokens.weight",
    "lm_head.weight",
)


def final_norm_state(model: Consolidated) -> dict[str, dict[str, torch.Tensor]]:
    """A pre-LN model's final LayerNorms, {"encoder": {"weight", "bias"}, "decoder": ...}, in Marian's coordinates
    (the basis permutation); none for post-LN."""
    if model.config.model.norm != "pre":
        return {}
    perm = basis_permutation(model.config.model.d_model)
    return {
        stack: {p: model.model[f"{stack}_norm.{p}"].index_select(0, perm).contiguous() for p in ("weight", "bias")}
        for stack in ("encoder", "decoder")
    }


def from_marian_state(state: dict[str, torch.Tensor], model: Consolidated, padded_rows: int) -> dict[str, torch.Tensor]:
    """megaformer's TP=1 parameters from a Marian state dict (the inverse of :func:`to_marian_state`).

    ``model`` supplies the config; the table is padded back to ``padded_rows`` zero rows.
    """
    m = model.config.model
    inverse = basis_permutation(m.d_model).argsort()
    table = next((state[n] for n in _TABLE_NAMES if n in state), None)
    if table is None:
        raise ExportError("the Marian weights hold no embedding table")
    embed = torch.zeros(padded_rows, m.d_model, dtype=table.dtype)
    embed[: table.shape[0]] = table.index_select(1, inverse)
    out = {"embed.weight": embed}
    for ours, theirs, dim in name_map(m.encoder_layers, m.decoder_layers):
        missing = [n for n in theirs if n not in state]
        if missing:
            raise ExportError(f"the Marian weights lack {missing[0]}")
        parts = [state[n] if dim is None else state[n].index_select(dim, inverse) for n in theirs]
        out[ours] = torch.cat(parts, dim=0).contiguous()
    return out


def marian_config(model: Consolidated) -> dict:
    """Keyword arguments of ``transformers.MarianConfig`` for ``model``."""
    m = model.config.model
    return dict(
        vocab_size=model.vocab_size,
        decoder_vocab_size=model.vocab_size,
        d_model=m.d_model,
        encoder_layers=m.encoder_layers,
        decoder_layers=m.decoder_layers,
        encoder_attention_heads=m.num_heads,
        decoder_attention_heads=m.num_heads,
        encoder_ffn_dim=m.d_ff,
        decoder_ffn_dim=m.d_ff,
        activation_function="relu",
        max_position_embeddings=m.max_positions,
        scale_embedding=True,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
        dropout=m.dropout,
        attention_dropout=m.attention_dropout,
        activation_dropout=m.activation_dropout,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        decoder_start_token_id=BOS_ID,
        forced_eos_token_id=EOS_ID,
        architectures=["MarianMTModel"],
    )


def generation_settings(model: Consolidated) -> dict:
    """``generation_config.json`` values: megaformer's start token, banned tokens and beam size.

    Marian scores a finished hypothesis logP / |Y|^alpha, megaformer ((5 + |Y|) / 6)^alpha (GNMT):
    the same alpha is the nearest setting, and alpha = 0 makes both plain logP.
    """
    d = model.config.decode
    return dict(
        decoder_start_token_id=BOS_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        forced_eos_token_id=EOS_ID,
        bad_words_ids=[[PAD_ID], [BOS_ID]],
        num_beams=d.beam,
        length_penalty=d.lenpen,
        early_stopping=True,
        max_length=model.config.model.max_positions,
    )
