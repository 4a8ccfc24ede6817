"""Beam and greedy search in one process: cache, beam 1, scores, lengths, batching, ties."""

import math
import random

import pytest
import torch
from decode_helpers import EOS, collate, model_from_state, one_thread, random_ids, reverse_id_state  # noqa: F401

from megaformer.decode.beam import SearchSettings, beam_search, greedy_search, length_penalty, max_output_lengths
from megaformer.decode.vocab_topk import vocab_parallel_topk
from megaformer.parallel import LOCAL

VOCAB = 100


@pytest.fixture(scope="module")
def model():
    return model_from_state(reverse_id_state(VOCAB), VOCAB)


@pytest.fixture(scope="module")
def sources() -> list[list[int]]:
    rng = random.Random(7)
    return [random_ids(rng, VOCAB, 1, 12) + [EOS] for _ in range(16)]


def pad(rows: list[list[int]]) -> torch.Tensor:
    out = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out


def same(a, b, tol=1e-5):
    assert [h.tokens for h in a] == [h.tokens for h in b]
    for x, y in zip(a, b):
        assert x.score == pytest.approx(y.score, abs=tol) and x.logprob == pytest.approx(y.logprob, abs=tol)


def test_the_test_model_makes_real_decisions(model, sources):
    """The partly trained model ends at varied lengths and beam search disagrees with greedy somewhere."""
    beam = beam_search(model, pad(sources), SearchSettings(beam=4))
    greedy = greedy_search(model, pad(sources), SearchSettings())
    assert len({len(h.tokens) for h in beam}) > 3
    assert any(b.tokens != g.tokens for b, g in zip(beam, greedy))
    assert sum(b.score >= g.score - 1e-6 for b, g in zip(beam, greedy)) >= len(sources) - 2


@pytest.mark.parametrize("beam", [1, 4, 6])
def test_cached_and_uncached_search_agree(model, sources, beam):
    src = pad(sources)
    cached = beam_search(model, src, SearchSettings(beam=beam))
    uncached = beam_search(model, src, SearchSettings(beam=beam, use_cache=False))
    same(cached, uncached)
    if beam == 1:
        same(greedy_search(model, src, SearchSettings()), greedy_search(model, src, SearchSettings(use_cache=False)))


def test_beam_one_is_greedy(model, sources):
    src = pad(sources)
    for lenpen in (0.0, 0.6, 1.0):
        same(
            beam_search(model, src, SearchSettings(beam=1, lenpen=lenpen)),
            greedy_search(model, src, SearchSettings(lenpen=lenpen)),
            tol=1e-9,
        )


def test_length_penalty_matches_hand_computed_values():
    assert length_penalty(1, 0.6) == pytest.approx(1.0)  # ((5 + 1) / 6) ** 0.6
    assert length_penalty(7, 0.6) == pytest.approx(2.0**0.6)  # (12 / 6) ** 0.6 = 1.515717
    assert length_penalty(7, 0.6) == pytest.approx(1.515717, abs=1e-6)
    assert length_penalty(10, 0.6) == pytest.approx(1.732862, abs=1e-6)  # (15 / 6) ** 0.6 = 2.5 ** 0.6
    assert length_penalty(49, 0.5) == pytest.approx(3.0)  # (54 / 6) ** 0.5 = 9 ** 0.5
    assert length_penalty(25, 1.0) == pytest.approx(5.0)  # (30 / 6)
    assert length_penalty(40, 0.0) == 1.0


def test_scores_are_the_model_log_probabilities_over_the_length_penalty(model, sources):
    """Against teacher forcing with a full log-softmax: logprob = log P(tokens + eos), score = logprob / lp."""
    hyps = beam_search(model, pad(sources), SearchSettings(beam=4, lenpen=0.6))
    for src, h in zip(sources, hyps):
        s, tgt_in, tgt_out = collate([(src[:-1], h.tokens)])
        with torch.no_grad():
            logp = torch.log_softmax(model(s, tgt_in)[0, :, :VOCAB].double(), dim=-1)
        expected = logp.gather(-1, tgt_out[0].unsqueeze(-1)).sum().item()
        assert h.logprob == pytest.approx(expected, abs=1e-4)
        assert h.score == pytest.approx(h.logprob / ((5 + len(h.tokens) + 1) / 6) ** 0.6, rel=1e-9)


def test_maximum_and_minimum_lengths(model, sources):
    src = pad(sources)
    n = torch.tensor([len(s) for s in sources])  # non-pad tokens, eos included
    assert max_output_lengths(src, 0, 64, 0.5, 1).tolist() == [math.floor(0.5 * x + 1) for x in n.tolist()]
    for search in (beam_search, greedy_search):
        hyps = search(model, src, SearchSettings(beam=3, max_len_a=0.5, max_len_b=1))
        assert all(len(h.tokens) <= math.floor(0.5 * x + 1) for h, x in zip(hyps, n.tolist()))
        assert any(len(h.tokens) == math.floor(0.5 * x + 1) for h, x in zip(hyps, n.tolist()))
        # min_len forces the length; the model's max_positions (64) caps it at 63 tokens + eos.
        forced = search(model, src[:3], SearchSettings(beam=2, max_len_a=0.0, max_len_b=9, min_len=9))
        assert [len(h.tokens) for h in forced] == [9, 9, 9]
        capped = search(model, src[:2], SearchSettings(beam=2, max_len_a=0.0, max_len_b=1000, min_len=1000))
        assert [len(h.tokens) for h in capped] == [63, 63]
        empty = search(model, src[:2], SearchSettings(beam=2, max_len_a=0.0, max_len_b=0))
        assert [h.tokens for h in empty] == [[], []]


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_mixed_batch_equals_one_sentence_at_a_time(model, sources, use_cache):
    settings = SearchSettings(beam=4, use_cache=use_cache)
    batched = beam_search(model, pad(sources), settings)
    alone = [beam_search(model, pad([s]), settings)[0] for s in sources]
    same(batched, alone, tol=1e-4)
    same(
        greedy_search(model, pad(sources), settings),
        [greedy_search(model, pad([s]), settings)[0] for s in sources],
        tol=1e-4,
    )


def test_topk_ties_go_to_the_lower_id_and_masks_hold():
    vocab = 20
    logits = torch.zeros(3, 128)
    logits[:, 10:14] = 5.0  # four tied best, cut by k = 3
    logits[:, 100] = 50.0  # padding row (>= vocab): never chosen, no probability
    logits[:, 0] = logits[:, 2] = 40.0  # pad and bos: never chosen, but in the normaliser
    logits[:, 3] = 4.0  # eos
    ban = torch.tensor([False, True, False])
    only = torch.tensor([False, False, True])
    c = vocab_parallel_topk(logits, 3, LOCAL, vocab, never=(0, 2), eos_id=3, ban_eos=ban, only_eos=only)
    assert c.token[0].tolist() == [10, 11, 12] and c.token[1].tolist() == [10, 11, 12]
    assert c.token[2, 0].item() == 3 and math.isinf(c.logprob[2, 1].item())
    lse = torch.logsumexp(logits[0, :vocab].double(), 0)
    assert c.logprob[0, 0].item() == pytest.approx(5.0 - lse.item())
    c = vocab_parallel_topk(logits, 6, LOCAL, vocab, never=(0, 2), eos_id=3)
    assert c.token[0].tolist() == [10, 11, 12, 13, 3, 1]


def test_wide_rows_give_torch_topks_values_and_ties_at_the_cut_to_the_lower_id():
    from megaformer.decode.vocab_topk import _block_topk

    g = torch.Generator().manual_seed(0)
    for n in (8000, 8003, 64 * 9):
        z = torch.randint(-40, 40, (50, n), generator=g).float()  # many ties
        z[:, :100] = float("-inf")  # masked columns, a masked block
        z[7] = float("-inf")
        z[7, n - 1] = 2.0  # a row whose one finite value sits past the last whole block
        values, index = _block_topk(z, 9)
        assert torch.equal(values, z.topk(9, dim=-1).values)
        assert torch.equal(z.gather(-1, index), values)
    z = torch.zeros(2, 8000)
    z[:, 5000:5020] = 1.0  # twenty tied best, cut at 9: the lowest ids, as torch's stable sort gives
    c = vocab_parallel_topk(z, 9, LOCAL, 8000, never=(0, 2), eos_id=3)
    assert c.token[0].tolist() == list(range(5000, 5009))


def test_search_refuses_training_mode(model, sources):
    model.train()
    try:
        with pytest.raises(ValueError, match="eval"):
            beam_search(model, pad(sources[:1]), SearchSettings())
    finally:
        model.eval()
