r"""Scoring translations: sacreBLEU's BLEU and chrF, with their signatures.

BLEU is computed by sacreBLEU on detokenized text against raw references, so the number
comes with a signature (tokenizer, smoothing, version) that says how it was made; the
paper's 27.3 / 28.4 EN-DE figures are tokenized BLEU and are not directly comparable.

:func:`tokenized_bleu` gives the paper's figure beside it, made as tensor2tensor's
``get_ende_bleu.sh`` of 2017 made it: both sides through Moses' ``tokenizer.perl -l LANG``
(its default HTML escaping of ``& | < > ' " [ ]``, no ``-a``), every hyphen between two
non-spaces written ``##AT##-##AT##`` (``perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g'``,
so a compound's halves count as words), then ``multi-bleu.perl``: cased corpus BLEU on
the whitespace-split tokens, no smoothing, 0 if an n-gram order has no match. sacremoses
is the Moses tokenizer of that time (it keeps a final abbreviation's dot, as
``tokenizer.perl`` did before November 2018). The script of April 2018 also ran
``replace-unicode-punctuation.perl`` on the hypotheses only (“ ” to "), never on the
pre-tokenized reference; that step is left out, as in the script the paper's numbers came from.

Checkpoint averaging lives in :mod:`megaformer.checkpoint.average`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import version

import sacrebleu
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


COMPOUND = re.compile(r"(\S)-(\S)")  # non-overlapping, as Perl's s///g: "a-b-c" -> "a ##AT##-##AT## b-c"


@dataclass(frozen=True)
class TokenizedBleu:
    """multi-bleu.perl's corpus BLEU of Moses-tokenized, compound-split text: the paper's metric."""

    bleu: float
    lang: str  # the Moses tokenizer's language (-l)
    signature: str  # nrefs:1|case:mixed|tok:moses-de|split:##AT##|smooth:none|sacremoses:0.2.0|version:2.6.0
    text: str  # as multi-bleu.perl prints it: "BLEU = 27.31, 58.1/33.2/20.9/13.6 (BP=1.000, ratio=..., ...)"


def moses_languages() -> tuple[str, ...]:
    """The languages tokenizer.perl has non-breaking prefixes for. sacremoses gives any other language
    English's, where tokenizer.perl has none: they are refused rather than tokenized differently."""
    from sacremoses.corpus import NonbreakingPrefixes  # 0.2 s of imports, only where it is used

    return tuple(sorted(set(NonbreakingPrefixes().available_langs.values())))


def moses_compound_split(lines: Sequence[str], lang: str) -> list[str]:
    """``tokenizer.perl -l lang`` (HTML escaping on), then each in-word hyphen as `` ##AT##-##AT## ``."""
    from sacremoses import MosesTokenizer

    if lang not in (known := moses_languages()):
        raise DataError(f"the Moses tokenizer has no language {lang!r}; one of {', '.join(known)}")
    moses = MosesTokenizer(lang=lang)
    tokenized = (moses.tokenize(line, escape=True, return_str=True) if line.strip() else "" for line in lines)
    return [COMPOUND.sub(r"\1 ##AT##-##AT## \2", line) for line in tokenized]


def tokenized_bleu(hypotheses: Sequence[str], references: Sequence[str], lang: str) -> TokenizedBleu:
    """The paper's tokenized, compound-split BLEU of detokenized ``hypotheses`` against raw ``references``.

    Both sides are tokenized the same way (:func:`moses_compound_split`); the score is
    sacreBLEU's with multi-bleu.perl's conventions (no tokenizer of its own, no smoothing,
    cased), and its line is formatted as multi-bleu.perl prints it.
    """
    if len(hypotheses) != len(references):
        raise DataError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    hyps, refs = moses_compound_split(hypotheses, lang), moses_compound_split(references, lang)
    s = BLEU(tokenize="none", smooth_method="none", force=True).corpus_score(hyps, [refs])
    precisions = "/".join(f"{p:.1f}" for p in s.precisions)
    ratio = s.sys_len / s.ref_len if s.ref_len else 0.0
    text = (
        f"BLEU = {s.score:.2f}, {precisions} "
        f"(BP={s.bp:.3f}, ratio={ratio:.3f}, hyp_len={s.sys_len}, ref_len={s.ref_len})"
    )
    signature = (
        f"nrefs:1|case:mixed|tok:moses-{lang}|split:##AT##|smooth:none|"
        f"sacremoses:{version('sacremoses')}|version:{sacrebleu.__version__}"
    )
    return TokenizedBleu(s.score, lang, signature, text)
