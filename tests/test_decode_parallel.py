"""TP=2 decoding equals TP=1 on the same weights (two gloo processes).

Each rank builds the TP=1 model and a TP=2 model loaded from the same TP=1 state
(:func:`load_full_state`), runs beam search (cached and uncached) and greedy search on
both, and checks that the hypotheses are the same. Two vocabularies: 100 (both ranks
hold many real rows of the padded 128) and 68 (rank 1 holds 4 real rows, fewer than
the 2 x beam candidates each rank proposes).
"""

import os
import random

import torch
from decode_helpers import EOS, model_from_state, one_thread, random_ids, reverse_id_state  # noqa: F401

from launcher.local import spawn
from megaformer.config import ParallelConfig
from megaformer.decode.beam import SearchSettings, beam_search, greedy_search
from megaformer.parallel import LOCAL, ParallelContext

SETTINGS = [SearchSettings(beam=4), SearchSettings(beam=4, use_cache=False), SearchSettings(beam=5, lenpen=1.0)]


def _sources(vocab: int) -> torch.Tensor:
    rng = random.Random(vocab)
    rows = [random_ids(rng, vocab, 1, 12) + [EOS] for _ in range(12)]
    src = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for i, r in enumerate(rows):
        src[i, : len(r)] = torch.tensor(r)
    return src


def _worker(states: dict) -> int:
    ctx = ParallelContext.initialize(ParallelConfig(tp=2, backend="gloo"), int(os.environ["RANK"]), 2)
    try:
        for vocab, path in states.items():
            state = torch.load(path)
            reference, parallel = model_from_state(state, vocab, LOCAL), model_from_state(state, vocab, ctx.tp)
            src = _sources(vocab)
            for settings in SETTINGS:
                want, got = beam_search(reference, src, settings), beam_search(parallel, src, settings)
                assert [h.tokens for h in got] == [h.tokens for h in want], (vocab, settings)
                assert all(abs(a.score - b.score) < 1e-5 for a, b in zip(got, want)), (vocab, settings)
            want, got = greedy_search(reference, src, SETTINGS[0]), greedy_search(parallel, src, SETTINGS[0])
            assert [h.tokens for h in got] == [h.tokens for h in want], (vocab, "greedy")
    finally:
        ctx.destroy()
    return 0


def test_tp2_decodes_what_tp1_decodes(tmp_path):
    states = {}
    for vocab in (100, 68):
        states[vocab] = str(tmp_path / f"state{vocab}.pt")
        torch.save(reverse_id_state(vocab), states[vocab])
    assert spawn(_worker, 2, states) == 0
