"""A built-in translation task, generated without any download, that needs attention to solve.

Two invented languages share nothing but meaning, mapped word by word through a fixed
lexicon (~300 roots):

* ``xx`` (source) is SVO with adjectives *after* the noun. Number and definiteness sit on
  the determiner (``ta`` / ``tas`` / ``ka`` / ``kas``), tense on the verb suffix.
* ``yy`` (target) is verb-final (S O [PP] V) with adjectives *before* the noun. Each noun
  has a grammatical gender (in the lexicon, not visible in the source); the determiner
  and every adjective agree with the noun in gender and number, the noun takes a
  plural suffix, and the verb agrees with the *subject's* number and the tense.

So producing a target word needs the right source word from elsewhere in the sentence:
reordering inside the noun phrase, the verb moved to the end, gender looked up from a
noun that comes later in the target, number and tense carried over a distance. A
model that copies or translates word by word in place scores poorly.

Example, glossed "the.PL fox brown chase.PAST the.SG hen red" -> "the.PL.M brown.PL.M fox.PL the.SG.M red.SG.M
hen chase.PAST.PL"::

    xx: tas nalipe perape mobei ta lotatu keko
    yy: gli vuzai kolyi il potozoo luleti kuvossen

The lexicon is fixed (its own seed); ``seed`` only changes which sentences are drawn.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

SRC_LANG, TGT_LANG = "xx", "yy"
_LEXICON_SEED = 20170612  # fixed: the languages never change, only the sentences drawn

GENDERS = ("m", "f", "n")
# Target determiners by definiteness, gender, number.
_DET = {
    (True, "m"): ("il", "gli"),
    (True, "f"): ("la", "le"),
    (True, "n"): ("lo", "li"),
    (False, "m"): ("un", "dei"),
    (False, "f"): ("una", "delle"),
    (False, "n"): ("uno", "degli"),
}
_NOUN_PLURAL = {"m": "i", "f": "e", "n": "a"}
_ADJ_ENDING = {
    ("m", False): "o",
    ("m", True): "i",
    ("f", False): "a",
    ("f", True): "e",
    ("n", False): "u",
    ("n", True): "ae",
}
_VERB_ENDING = {("present", False): "t", ("present", True): "nt", ("past", False): "st", ("past", True): "ssen"}
# Source determiners by definiteness and number; tense suffixes on source verbs.
_SRC_DET = {(True, False): "ta", (True, True): "tas", (False, False): "ka", (False, True): "kas"}
_SRC_TENSE = {"present": "a", "past": "i"}


@dataclass(frozen=True)
class Lexicon:
    """Source root -> target root for each word class; each target noun has a gender."""

    nouns: tuple[tuple[str, str, str], ...]  # (source, target stem, gender)
    adjectives: tuple[tuple[str, str], ...]
    verbs: tuple[tuple[str, str], ...]
    prepositions: tuple[tuple[str, str], ...]


def _words(rng: random.Random, count: int, onsets: str, vowels: str, taken: set[str]) -> list[str]:
    words = []
    while len(words) < count:
        word = "".join(rng.choice(onsets) + rng.choice(vowels) for _ in range(rng.randint(2, 3)))
        if word not in taken:
            taken.add(word)
            words.append(word)
    return words


def build_lexicon(nouns: int = 150, adjectives: int = 60, verbs: int = 60, prepositions: int = 10) -> Lexicon:
    """The fixed lexicon (same every call): invented, distinct words for both languages."""
    rng = random.Random(_LEXICON_SEED)
    src_taken: set[str] = set(_SRC_DET.values())
    tgt_taken: set[str] = {w for forms in _DET.values() for w in forms}
    src = _words(rng, nouns + adjectives + verbs + prepositions, "bdgklmnprst", "aeiou", src_taken)
    tgt = _words(rng, nouns + adjectives + verbs + prepositions, "fvzlmnrtkp", "aeiouy", tgt_taken)
    a, b, c = nouns, nouns + adjectives, nouns + adjectives + verbs
    return Lexicon(
        nouns=tuple((src[i], tgt[i], rng.choice(GENDERS)) for i in range(a)),
        adjectives=tuple(zip(src[a:b], tgt[a:b])),
        verbs=tuple(zip(src[b:c], tgt[b:c])),
        prepositions=tuple(zip(src[c:], tgt[c:])),
    )


def _noun_phrase(rng: random.Random, lex: Lexicon) -> tuple[list[str], list[str], bool]:
    """(source words, target words, plural) of a determiner + noun + 0-2 adjectives."""
    src_noun, tgt_noun, gender = rng.choice(lex.nouns)
    definite, plural = rng.random() < 0.5, rng.random() < 0.4
    adjectives = rng.sample(lex.adjectives, k=rng.choice((0, 0, 1, 1, 2)))
    src = [_SRC_DET[definite, plural], src_noun] + [s for s, _ in adjectives]
    tgt = (
        [_DET[definite, gender][plural]]
        + [t + _ADJ_ENDING[gender, plural] for _, t in adjectives]
        + [tgt_noun + (_NOUN_PLURAL[gender] if plural else "")]
    )
    return src, tgt, plural


def generate_pair(rng: random.Random, lex: Lexicon) -> tuple[str, str]:
    """One sentence pair: ``S V O [P NP]`` in the source, ``S O [P NP] V`` in the target."""
    subj_src, subj_tgt, subj_plural = _noun_phrase(rng, lex)
    obj_src, obj_tgt, _ = _noun_phrase(rng, lex)
    src_verb, tgt_verb = rng.choice(lex.verbs)
    tense = rng.choice(("present", "past"))
    src = subj_src + [src_verb + _SRC_TENSE[tense]] + obj_src
    tgt = subj_tgt + obj_tgt
    if rng.random() < 0.35:
        src_prep, tgt_prep = rng.choice(lex.prepositions)
        pp_src, pp_tgt, _ = _noun_phrase(rng, lex)
        src += [src_prep] + pp_src
        tgt += [tgt_prep] + pp_tgt
    tgt.append(tgt_verb + _VERB_ENDING[tense, subj_plural])
    return " ".join(src), " ".join(tgt)


def write_synthetic_corpus(out_dir: str | Path, n_train: int, n_valid: int, n_test: int, seed: int) -> dict[str, Path]:
    """Write ``train``, ``valid`` and ``test`` corpora (``PREFIX.xx`` / ``PREFIX.yy``) into ``out_dir``.

    Returns ``{"train": out_dir/"train", "valid": ..., "test": ...}``, the prefixes to give
    ``megaformer prepare --src xx --tgt yy``. The same arguments write the same bytes.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lex = build_lexicon()
    prefixes = {}
    for index, (split, count) in enumerate((("train", n_train), ("valid", n_valid), ("test", n_test))):
        rng = random.Random(f"{seed}/{index}")
        pairs = [generate_pair(rng, lex) for _ in range(count)]
        prefix = out_dir / split
        for lang, side in ((SRC_LANG, 0), (TGT_LANG, 1)):
            Path(f"{prefix}.{lang}").write_text("".join(p[side] + "\n" for p in pairs), encoding="utf-8")
        prefixes[split] = prefix
    return prefixes
