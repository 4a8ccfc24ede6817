"""Scoring translations: sacreBLEU's BLEU and chrF, with their signatures.

BLEU is computed by sacreBLEU on detokenized text against raw references, so the number
comes with a signature (tokenizer, smoothing, version) that says how it was made; the
paper's 27.3 / 28.4 EN-DE figures are tokenized BLEU and are not directly comparable.

Checkpoint averaging lives in :mod:`megaformer.checkpoint.average`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sacrebleu.metrics import BLEU, CHRF

from megaformer.errors import DataError


@dataclass(frozen=True)
class Scores:
    """Corpus-level scores of one set of hypotheses."""

    bleu: float  # cased (sacreBLEU's default)
    chrf: float
    bleu_signature: str  # e.g. nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0
    chrf_signature: str
    bleu_text: str  # sacreBLEU's line: "BLEU|<signature> = 27.31 58.1/33.2/20.9/13.6 (BP = ...)"
    chrf_text: str
    bleu_lc: float  # lowercased (sacreBLEU -lc), what Multi30k papers report
    bleu_lc_signature: str  # ...|case:lc|...
    bleu_lc_text: str


def corpus_scores(hypotheses: Sequence[str], references: Sequence[str], tokenize: str = "13a") -> Scores:
    """sacreBLEU corpus BLEU (cased and lowercased) and chrF of detokenized ``hypotheses``, one reference each."""
    if len(hypotheses) != len(references):
        raise DataError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    if not hypotheses:
        raise DataError("no sentences to score")
    bleu, bleu_lc, chrf = BLEU(tokenize=tokenize), BLEU(tokenize=tokenize, lowercase=True), CHRF()
    hyps, refs = list(hypotheses), [list(references)]
    b, lc, c = bleu.corpus_score(hyps, refs), bleu_lc.corpus_score(hyps, refs), chrf.corpus_score(hyps, refs)
    b_sig, lc_sig, c_sig = str(bleu.get_signature()), str(bleu_lc.get_signature()), str(chrf.get_signature())
    return Scores(
        b.score,
        c.score,
        b_sig,
        c_sig,
        b.format(signature=b_sig),
        c.format(signature=c_sig),
        lc.score,
        lc_sig,
        lc.format(signature=lc_sig),
    )
