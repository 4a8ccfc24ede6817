"""Decoding and evaluation: beam search, sacreBLEU (checkpoint averaging is :mod:`megaformer.checkpoint.average`).

The commands that use them live in :mod:`megaformer.commands`: ``translate``, ``evaluate`` and ``average``.
"""

from megaformer.decode.beam import Hypothesis, SearchSettings, beam_search, greedy_search, length_penalty, search
from megaformer.decode.evaluate import Scores, corpus_scores
from megaformer.decode.loading import build_model, load_model_file, load_tokenizer
from megaformer.decode.vocab_topk import Candidates, vocab_parallel_topk

__all__ = [
    "Candidates",
    "Hypothesis",
    "Scores",
    "SearchSettings",
    "beam_search",
    "build_model",
    "corpus_scores",
    "greedy_search",
    "length_penalty",
    "load_model_file",
    "load_tokenizer",
    "search",
    "vocab_parallel_topk",
]
