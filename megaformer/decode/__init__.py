"""Decoding and evaluation: beam search, sacreBLEU (checkpoint averaging is :mod:`megaformer.checkpoint.average`).

The commands live in :mod:`~megaformer.decode.translate` (``translate``),
:mod:`~megaformer.decode.evaluate_command` (``evaluate``) and
:mod:`~megaformer.decode.average_command` (``average``).
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
