"""A corpus with WMT'14 en-de's shape, for measuring speed: lengths, vocabulary and their tails, not a language.

What a training step costs depends on the shapes a corpus gives it: sentence lengths
(padding, attention, the number of micro-batches), the vocabulary (the output layer and
the loss) and how the two vary. The built-in task (:mod:`megaformer.data.synthetic`)
has short sentences and ~1,000 pieces; WMT'14 en-de, what the paper's models train on,
averages ~27 pieces a side under a 37,000-piece joint BPE, with a long tail to the
filter's limit. This corpus has that shape without a download:

* two invented lexicons of :data:`WORDS` words each (syllable strings), drawn with
  Zipf's law (exponent 1), so BPE learns whole pieces for the frequent words and
  splits the rare ones, as it does on news text; together they fill a 37,000-piece
  joint vocabulary;
* source lengths in words from a log-normal (median 15.5, sigma 0.6: mean ~19 words,
  ~27 pieces, 99th percentile ~63 words), cut at :data:`MAX_WORDS`;
* the target a word-for-word image of the source through a fixed lexicon, its length
  the source's times a log-normal ratio (sigma 0.12), locally reordered, extra words
  drawn from the target's own distribution.

A model can learn the word mapping, so loss curves look like training; BLEU on it means
nothing. The lexicons are fixed (their own seed); ``seed`` only changes the sentences.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SRC_LANG, TGT_LANG = "xs", "ys"
WORDS = 60_000  # words per language
MAX_WORDS = 200  # longest sentence, in words (prepare's --max-len then cuts in pieces)
_LEXICON_SEED = 20141201
_ONSETS = ("", "b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "ch", "sh", "st", "tr", "pl")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ei", "ou")
_CODAS = ("", "", "", "n", "r", "s", "l", "t", "m", "k")


def _lexicon(rng: np.random.Generator, words: int) -> np.ndarray:
    """``words`` distinct syllable strings, the frequent ranks shorter (as in natural languages)."""
    syllables = np.array([o + v + c for o in _ONSETS for v in _VOWELS for c in dict.fromkeys(_CODAS)])
    seen: set[str] = set()
    lexicon: list[str] = []
    while len(lexicon) < words:
        rank = len(lexicon)
        count = 1 + (rank > 100) + (rank > 3000) + int(rng.random() < 0.35)
        word = "".join(rng.choice(syllables, size=count))
        if word not in seen:
            seen.add(word)
            lexicon.append(word)
    return np.array(lexicon)


def _zipf(rng: np.random.Generator, size: int) -> np.ndarray:
    """Word ranks in ``[0, WORDS)`` with probability proportional to 1 / (rank + 2)."""
    weights = 1.0 / (np.arange(WORDS) + 2.0)
    return np.searchsorted(np.cumsum(weights / weights.sum()), rng.random(size)).clip(0, WORDS - 1)


def _sentences(lexicon: np.ndarray, ranks: np.ndarray, lengths: np.ndarray) -> list[str]:
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    words = lexicon[ranks]
    return [" ".join(words[bounds[i] : bounds[i + 1]]) for i in range(len(lengths))]


def generate(count: int, seed: int) -> tuple[list[str], list[str]]:
    """``count`` source and target sentences; the same arguments give the same text."""
    lexicons = np.random.default_rng(_LEXICON_SEED)
    src_lexicon, tgt_lexicon = _lexicon(lexicons, WORDS), _lexicon(lexicons, WORDS)
    # Source rank -> target rank: a word keeps about its frequency (ranks moved by ~30 %).
    mapping = np.argsort(np.argsort(np.arange(1, WORDS + 1) * lexicons.lognormal(0.0, 0.3, WORDS), kind="stable"))
    rng = np.random.default_rng([seed, 27])
    src_len = np.clip(np.rint(rng.lognormal(np.log(15.5), 0.6, count)), 1, MAX_WORDS).astype(np.int64)
    tgt_len = np.clip(np.rint(src_len * rng.lognormal(0.0, 0.12, count)), 1, MAX_WORDS).astype(np.int64)
    src_ranks = _zipf(rng, int(src_len.sum()))
    # The target: the source's words mapped, shuffled within windows of 3, then cut or padded with own words.
    src_bounds = np.concatenate([[0], np.cumsum(src_len)])
    extra = _zipf(rng, int(np.maximum(tgt_len - src_len, 0).sum()))
    tgt_ranks, used = [], 0
    for i in range(count):
        words = mapping[src_ranks[src_bounds[i] : src_bounds[i + 1]]]
        jitter = np.arange(len(words)) + rng.random(len(words)) * 3
        words = words[np.argsort(jitter, kind="stable")][: tgt_len[i]]
        need = int(tgt_len[i]) - len(words)
        if need > 0:
            words = np.concatenate([words, extra[used : used + need]])
            used += need
        tgt_ranks.append(words)
    return _sentences(src_lexicon, src_ranks, src_len), _sentences(tgt_lexicon, np.concatenate(tgt_ranks), tgt_len)


def write_wmt_shaped_corpus(out_dir: str | Path, n_train: int, n_valid: int, n_test: int, seed: int) -> dict[str, Path]:
    """Write ``train``, ``valid`` and ``test`` (``PREFIX.xs`` / ``PREFIX.ys``) into ``out_dir``; their prefixes."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prefixes = {}
    for index, (split, count) in enumerate((("train", n_train), ("valid", n_valid), ("test", n_test))):
        src, tgt = generate(count, seed * 3 + index)
        prefix = out_dir / split
        for lang, lines in ((SRC_LANG, src), (TGT_LANG, tgt)):
            Path(f"{prefix}.{lang}").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        prefixes[split] = prefix
    return prefixes
