"""The built-in corpus: deterministic, and a real translation task (reordering and agreement), not a copy."""

from __future__ import annotations

import random
from pathlib import Path

from megaformer.data.synthetic import _DET, _SRC_DET, _VERB_ENDING, build_lexicon, generate_pair, write_synthetic_corpus


def test_same_seed_same_bytes_other_seed_other_sentences(tmp_path: Path) -> None:
    a = write_synthetic_corpus(tmp_path / "a", 200, 20, 10, seed=1)
    b = write_synthetic_corpus(tmp_path / "b", 200, 20, 10, seed=1)
    c = write_synthetic_corpus(tmp_path / "c", 200, 20, 10, seed=2)
    assert set(a) == {"train", "valid", "test"}
    for split in a:
        for lang in ("xx", "yy"):
            text = Path(f"{a[split]}.{lang}").read_text()
            assert text == Path(f"{b[split]}.{lang}").read_text()
            assert text != Path(f"{c[split]}.{lang}").read_text()
            assert len(text.splitlines()) == {"train": 200, "valid": 20, "test": 10}[split]


def test_lexicon_is_fixed_and_a_few_hundred_words() -> None:
    lex = build_lexicon()
    assert lex == build_lexicon()
    roots = len(lex.nouns) + len(lex.adjectives) + len(lex.verbs) + len(lex.prepositions)
    assert 200 <= roots <= 400
    assert len({s for s, _, _ in lex.nouns}) == len(lex.nouns)


def test_target_is_verb_final_with_agreement() -> None:
    lex = build_lexicon()
    nouns = {src: (tgt, gender) for src, tgt, gender in lex.nouns}
    verbs = dict(lex.verbs)
    src_det = {v: k for k, v in _SRC_DET.items()}
    rng = random.Random(0)
    for _ in range(300):
        src, tgt = generate_pair(rng, lex)
        s, t = src.split(), tgt.split()
        assert s != t and len(t) == len(s)  # word for word in count, not in order
        definite, plural = src_det[s[0]]
        target_noun, gender = nouns[s[1]]
        assert t[0] == _DET[definite, gender][plural]  # article agrees with the (later) noun
        verb = next(w for w in s if w[:-1] in verbs)  # the source verb follows the subject phrase
        tense = "present" if verb.endswith("a") else "past"
        assert t[-1] == verbs[verb[:-1]] + _VERB_ENDING[tense, plural]  # verb last, agrees with the subject
