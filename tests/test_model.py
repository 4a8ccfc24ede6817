"""The whole model in one process: torch.nn.Transformer as reference, decoding cache, TP-independent init."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megaformer.config import ModelConfig
from megaformer.model import DecoderCache, Transformer, sinusoidal_positions
from megaformer.parallel import LOCAL, DropoutRNG, TPGroup, shard_full

CFG = ModelConfig(d_model=32, d_ff=64, num_heads=4, encoder_layers=2, decoder_layers=2, dropout=0.0, max_positions=64)
VOCAB = 50


def make(cfg: ModelConfig = CFG, tp: TPGroup = LOCAL, seed: int = 3) -> Transformer:
    return Transformer(cfg, VOCAB, tp, DropoutRNG(seed, tp), seed=seed)


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, VOCAB, (3, 9), generator=g)
    tgt = torch.randint(4, VOCAB, (3, 7), generator=g)
    src[1, 6:] = 0
    src[2, 3:] = 0
    tgt[2, 4:] = 0
    return src, tgt


def test_sinusoidal_positions_follow_the_paper():
    pe = sinusoidal_positions(50, 16)
    pos, i = 17, 3
    assert pe[pos, 2 * i].item() == pytest.approx(math.sin(pos / 10000 ** (2 * i / 16)), abs=1e-6)
    assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(pos / 10000 ** (2 * i / 16)), abs=1e-6)


def _torch_reference(model: Transformer) -> nn.Transformer:
    """torch.nn.Transformer (pre-LN, whose final encoder/decoder norms match ours) holding our weights."""
    c = model.cfg
    ref = nn.Transformer(
        c.d_model,
        c.num_heads,
        c.encoder_layers,
        c.decoder_layers,
        c.d_ff,
        dropout=0.0,
        batch_first=True,
        norm_first=True,
        layer_norm_eps=c.layernorm_eps,
    )
    d = c.d_model
    with torch.no_grad():
        for ours, theirs in zip(model.encoder, ref.encoder.layers):
            theirs.self_attn.in_proj_weight.copy_(ours.self_attn.qkv.weight)
            theirs.self_attn.in_proj_bias.copy_(ours.self_attn.qkv.bias)
            theirs.self_attn.out_proj.weight.copy_(ours.self_attn.out.weight)
            theirs.self_attn.out_proj.bias.copy_(ours.self_attn.out.bias)
            for a, b in (
                (ours.ffn.fc1, theirs.linear1),
                (ours.ffn.fc2, theirs.linear2),
                (ours.norm1, theirs.norm1),
                (ours.norm2, theirs.norm2),
            ):
                b.weight.copy_(a.weight), b.bias.copy_(a.bias)
        for ours, theirs in zip(model.decoder, ref.decoder.layers):
            theirs.self_attn.in_proj_weight.copy_(ours.self_attn.qkv.weight)
            theirs.self_attn.in_proj_bias.copy_(ours.self_attn.qkv.bias)
            theirs.self_attn.out_proj.weight.copy_(ours.self_attn.out.weight)
            theirs.self_attn.out_proj.bias.copy_(ours.self_attn.out.bias)
            theirs.multihead_attn.in_proj_weight.copy_(torch.cat([ours.cross_attn.q.weight, ours.cross_attn.kv.weight]))
            theirs.multihead_attn.in_proj_bias.copy_(torch.cat([ours.cross_attn.q.bias, ours.cross_attn.kv.bias]))
            theirs.multihead_attn.out_proj.weight.copy_(ours.cross_attn.out.weight)
            theirs.multihead_attn.out_proj.bias.copy_(ours.cross_attn.out.bias)
            for a, b in (
                (ours.ffn.fc1, theirs.linear1),
                (ours.ffn.fc2, theirs.linear2),
                (ours.norm1, theirs.norm1),
                (ours.norm2, theirs.norm2),
                (ours.norm3, theirs.norm3),
            ):
                b.weight.copy_(a.weight), b.bias.copy_(a.bias)
        for a, b in ((model.encoder_norm, ref.encoder.norm), (model.decoder_norm, ref.decoder.norm)):
            b.weight.copy_(a.weight), b.bias.copy_(a.bias)
    assert d == c.d_model
    return ref


def test_model_equals_torch_nn_transformer():
    """An independent reference for attention, masks, embeddings and the smoothed loss."""
    cfg = ModelConfig(**{**CFG.__dict__, "norm": "pre"})
    model = make(cfg)
    ref = _torch_reference(model)
    src, tgt = batch()
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
    emb = model.embed.weight[:VOCAB]
    pe = sinusoidal_positions(64, cfg.d_model)

    def embed(ids):
        return F.embedding(ids, emb) * math.sqrt(cfg.d_model) + pe[: ids.shape[1]]

    causal = nn.Transformer.generate_square_subsequent_mask(tgt_in.shape[1])
    hidden = ref(
        embed(src),
        embed(tgt_in),
        tgt_mask=causal,
        src_key_padding_mask=src.eq(0),
        memory_key_padding_mask=src.eq(0),
        tgt_is_causal=True,
    )
    ref_logits = F.linear(hidden, emb)
    ref_loss = F.cross_entropy(
        ref_logits.flatten(0, 1), tgt_out.flatten(), ignore_index=0, label_smoothing=0.1, reduction="sum"
    )
    model.eval()
    logits = model(src, tgt_in)[..., :VOCAB]
    real = tgt_in.ne(0)  # padded target positions are not compared: their outputs are never used
    torch.testing.assert_close(logits[real], ref_logits[real], rtol=1e-4, atol=1e-4)
    loss, ntok = model.loss(src, tgt_in, tgt_out, 0.1)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert ntok == int(tgt_out.ne(0).sum())


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_cached_decoding_equals_full_forward(norm):
    model = make(ModelConfig(**{**CFG.__dict__, "norm": norm}))
    model.eval()
    src, tgt = batch(1)
    with torch.no_grad():
        full = model(src, tgt)
        memory, mask = model.encode(src)
        cache = DecoderCache(len(model.decoder))
        steps = [model.logits(model.decode(tgt[:, i : i + 1], memory, mask, cache)) for i in range(tgt.shape[1])]
        # A prefix of several positions, then single steps, must agree too.
        cache2 = DecoderCache(len(model.decoder))
        prefix = model.logits(model.decode(tgt[:, :3], memory, mask, cache2))
        rest = [model.logits(model.decode(tgt[:, i : i + 1], memory, mask, cache2)) for i in range(3, tgt.shape[1])]
    assert (torch.cat(steps, 1) - full).abs().max().item() <= 1e-5
    assert (torch.cat([prefix] + rest, 1) - full).abs().max().item() <= 1e-5


def test_cache_reorder_follows_beams():
    model = make()
    model.eval()
    src, tgt = batch(2)
    with torch.no_grad():
        memory, mask = model.encode(src)
        cache = DecoderCache(len(model.decoder))
        model.decode(tgt[:, :2], memory, mask, cache)
        order = torch.tensor([2, 0, 1])
        cache.reorder(order, sources=order)  # rows that are whole sentences: their sources follow
        step = model.logits(model.decode(tgt[order, 2:3], memory[order], mask[order], cache))
        full = model(src[order], tgt[order, :3])[:, -1:]
    assert (step - full).abs().max().item() <= 1e-5


def test_hypotheses_of_one_source_share_its_cross_attention_keys():
    """Beam search's layout: ``beam`` consecutive target rows per source row attend to that source, whose keys
    and values are computed once; equal to the same rows decoded with the source repeated for each."""
    model = make()
    model.eval()
    src, tgt = batch(3)
    beam = 2
    rows = torch.arange(src.shape[0]).repeat_interleave(beam)
    hyps = tgt[rows].clone()
    hyps[1::beam, 1:] = 4 + (hyps[1::beam, 1:] + 1) % (VOCAB - 4)  # the second hypothesis of each differs
    with torch.no_grad():
        memory, mask = model.encode(src)
        shared, cache = [], DecoderCache(len(model.decoder))
        for i in range(hyps.shape[1]):
            shared.append(model.logits(model.decode(hyps[:, i : i + 1], memory, mask, cache)))
        repeated = model(src[rows], hyps)
        with pytest.raises(ValueError, match="cannot share 3 sources"):
            model.decode(hyps[:4, :1], memory, mask)
    assert cache.cross_attn[0]["k"].shape[0] == src.shape[0]
    assert (torch.cat(shared, 1) - repeated).abs().max().item() <= 1e-5


@pytest.mark.parametrize("tp_size", [2, 4])
def test_init_is_independent_of_tp(tp_size):
    """The TP=N shard of every weight equals the slice of the TP=1 weight from the same seed."""
    cfg = ModelConfig(**{**CFG.__dict__, "num_heads": 4, "d_ff": 64})
    full = dict(make(cfg).named_parameters())
    for rank in range(tp_size):
        tp = TPGroup(group=None, size=tp_size, rank=rank)  # construction needs no communication
        shard = make(cfg, tp)
        for name, p in shard.named_parameters():
            expected = shard_full(full[name].detach(), getattr(p, "tp_dim", None), getattr(p, "tp_partitions", 1), tp)
            assert torch.equal(p.detach(), expected), f"{name} differs at TP={tp_size} rank {rank}"


def test_padding_rows_and_pad_embedding_are_zero():
    model = make()
    assert bool((model.embed.weight[VOCAB:] == 0).all()) or model.embed.weight.shape[0] == VOCAB
    assert bool((model.embed.weight[0] == 0).all())


def test_sequence_longer_than_positions_is_a_clear_error():
    model = make()
    src = torch.randint(4, VOCAB, (1, 70))
    with pytest.raises(ValueError, match="max_positions=64"):
        model.encode(src)


@pytest.mark.parametrize("attention_dropout", [0.0, 0.2])
def test_unpadded_source_gives_the_output_of_no_mask(attention_dropout, monkeypatch):
    """The source mask is passed also when nothing is padded (no host sync); results stay bitwise equal."""
    cfg = ModelConfig(**{**CFG.__dict__, "attention_dropout": attention_dropout})
    src, tgt = batch()
    src = src[:1, :6]  # row 0 of length 6 has no padding
    tgt_in = torch.cat([torch.full((1, 1), 2), tgt[:1, :-1]], 1)
    with_mask = make(cfg)(src, tgt_in)
    monkeypatch.setattr(Transformer, "source_mask", lambda self, s: None)  # what the model did before
    without = make(cfg)(src, tgt_in)
    assert torch.equal(with_mask, without)


def test_training_forward_reads_nothing_on_the_host(monkeypatch):
    """A micro-batch's forward and loss never wait for the device: no tensor is read as a Python value."""
    model = make(ModelConfig(**{**CFG.__dict__, "dropout": 0.1, "attention_dropout": 0.1}))
    src, tgt = batch()
    tgt_in = torch.cat([torch.full((3, 1), 2), tgt[:, :-1]], 1)

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was read on the host (a GPU would synchronise here)")

    for name in ("__bool__", "__int__", "__float__", "__index__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    loss, count = model.loss(src, tgt_in, tgt, 0.1)
    loss.backward()
    monkeypatch.undo()
    assert int(count) == int(tgt.ne(0).sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_matmul_attention_equals_sdpa(dtype):
    """The CPU's matmul path (short sources) against torch's fused SDPA: padding, causal, cached queries."""
    from megaformer.model.attention import attend, uses_matmul_attention

    g = torch.Generator().manual_seed(0)
    rng = DropoutRNG(1, LOCAL)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for t, s, causal, padded in ((7, 7, False, True), (7, 7, True, True), (3, 9, True, True), (7, 7, True, False)):
        q = torch.randn(2, 4, t, 16, generator=g).to(dtype)
        k, v = (torch.randn(2, 4, s, 16, generator=g).to(dtype) for _ in range(2))
        mask = torch.ones(2, 1, 1, s, dtype=torch.bool)
        mask[1, :, :, s - 2 :] = not padded  # padded keys, or none (a decoder's self-attention: no mask)
        assert uses_matmul_attention(q, k, 0.0)
        visible = mask & torch.ones(t, s, dtype=torch.bool).tril(s - t) if causal else mask
        expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=visible)
        got = attend(q, k, v, mask if padded else None, causal, 0.0, rng)
        torch.testing.assert_close(got.float(), expected, **tol)
