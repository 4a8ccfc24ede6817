"""Preparing parallel text: cleaned pairs -> shared sentencepiece -> shards + manifest (:func:`prepare`).

Steps: open every corpus and check what can be checked without reading it through (files
there, archives whole, their pairs found: :func:`open_inputs`, before anything is
written); read each corpus in step and filter the training pairs (counted by reason,
for the split and for each corpus, see :mod:`megaformer.data.corpus`); train one BPE
model on the cleaned training text of both sides (or reuse ``PrepareSettings.spm``);
encode; write training pairs in a seeded random order (so that every shard is a uniform
sample) and valid/test pairs in line order; write the manifest last (format:
:mod:`megaformer.data.shards`; each split lists the sides it read under ``sources``, and
train counts each corpus under ``corpora``).

``bpe_dropout`` P with ``bpe_copies`` K stores K BPE-dropout segmentations of every kept
training pair instead of its one plain segmentation (subword regularisation done once,
when the data is prepared, so streaming stays a read of token ids): the length filters
judge the plain segmentation, and a sampled one that breaks them is replaced by it.

The output is built in ``DIR.tmp-XXXX`` next to ``DIR`` and renamed into place at the
end: an interrupted run leaves no ``DIR`` (and never one with a manifest). The same
inputs and seed give byte-identical shards, tokenizer and manifest. What may be replaced
(``--force``) and what is refused is decided by ``megaformer prepare``
(:mod:`megaformer.commands.prepare`); :func:`made_by_prepare` tells it an earlier output.
"""

from __future__ import annotations

import bisect
import itertools
import json
import logging
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from megaformer.config import DataConfig
from megaformer.data.corpus import (
    FilterSettings,
    ParallelCorpus,
    SplitCounts,
    TextFilter,
    length_reject,
    normalize,
    one_line,
    reference_text,
)
from megaformer.data.manifest import FORMAT, VERSION, write_manifest
from megaformer.data.shards import ShardWriter, token_dtype
from megaformer.data.synthetic import SRC_LANG, TGT_LANG, write_synthetic_corpus
from megaformer.data.tokenizer import Tokenizer, train_bpe
from megaformer.data.wmt import open_corpora
from megaformer.data.wmt_shaped import SRC_LANG as WMT_SRC_LANG
from megaformer.data.wmt_shaped import TGT_LANG as WMT_TGT_LANG
from megaformer.data.wmt_shaped import write_wmt_shaped_corpus
from megaformer.errors import DataError
from megaformer.files import atomic_output
from megaformer.logs import STDERR

LOG = logging.getLogger(__name__)

_ENCODE_CHUNK = 10000  # lines encoded per sentencepiece call
# The corpora ``prepare --synthetic N`` generates, and their default vocabularies.
SYNTHETIC_SHAPES = ("task", "wmt14")
SYNTHETIC_VOCAB = {"task": 1000, "wmt14": 37000}
SYNTHETIC_CORPUS = "corpus"  # the folder of the prepared directory that holds the generated text of --synthetic


@dataclass(frozen=True)
class PrepareSettings:
    """One ``prepare`` run: the corpora read, the tokenizer trained (or reused), the filters and the shards written.

    ``train`` corpora are concatenated in the order given; each is a PREFIX (``PREFIX.<src>`` /
    ``PREFIX.<tgt>``, plain or .gz, or WMT's SGML pair) or ``ARCHIVE[:NAME]``, whose pairs
    are all read (:mod:`megaformer.data.wmt`). ``valid`` and ``test`` name one pair each and
    keep every line. ``synthetic`` N generates the built-in corpus
    of N training pairs (and its valid and test splits, languages xx/yy) inside the output
    instead; with ``synthetic_shape="wmt14"``, a corpus of WMT'14 en-de's shape (languages
    xs/ys, :mod:`megaformer.data.wmt_shaped`). ``spm`` reuses a sentencepiece model instead of training one of
    ``vocab_size`` pieces on at most ``spm_sentences`` sentences (0 = all).
    ``bpe_dropout`` P > 0 stores ``bpe_copies`` sampled segmentations of every training pair.
    """

    train: tuple[str, ...] = ()
    valid: str | None = None
    test: str | None = None
    synthetic: int | None = None
    synthetic_shape: str = "task"
    src: str = DataConfig.src_lang
    tgt: str = DataConfig.tgt_lang
    vocab_size: int = DataConfig.vocab_size
    spm: str | None = None
    spm_sentences: int = 10_000_000
    character_coverage: float = 1.0
    bpe_dropout: float = 0.0
    bpe_copies: int = 1
    filters: FilterSettings = field(default_factory=FilterSettings)
    shard_size: int = 10000
    seed: int = DataConfig.seed
    quiet: bool = False


class Progress:
    """Lines read / kept and lines per second on stderr, every few seconds and once per split."""

    def __init__(self, quiet: bool, interval: float = 2.0) -> None:
        self.quiet, self.interval = quiet, interval
        self._start = self._last = time.monotonic()

    def start(self) -> None:
        self._start = self._last = time.monotonic()

    def update(self, what: str, counts: SplitCounts, *, final: bool = False) -> None:
        now = time.monotonic()
        if self.quiet or (not final and now - self._last < self.interval):
            return
        self._last = now
        rate = counts.read / max(now - self._start, 1e-9)
        LOG.info(
            f"prepare {what}: read {counts.read:,} kept {counts.kept:,} ({rate:,.0f} lines/s)"
            + ("" if not final else f" rejected {dict(+counts.rejected) or 'none'}"),
            extra=STDERR,
        )

    def corpus(self, what: str, name: str, counts: SplitCounts) -> None:
        """The final counts of one of several corpora of a split."""
        if not self.quiet:
            LOG.info(
                f"prepare {what} {name}: read {counts.read:,} kept {counts.kept:,} "
                f"rejected {dict(+counts.rejected) or 'none'}",
                extra=STDERR,
            )


class EncodedPairs:
    """Token ids of many pairs, kept as flat arrays per chunk plus lengths (not millions of small lists)."""

    def __init__(self, dtype: np.dtype) -> None:
        self.dtype = dtype
        self._src: list[np.ndarray] = []
        self._tgt: list[np.ndarray] = []
        self._lens: list[np.ndarray] = []

    def add(self, pairs: list[tuple[list[int], list[int]]]) -> None:
        """Append a chunk of pairs."""
        self._src.append(np.fromiter(itertools.chain.from_iterable(s for s, _ in pairs), dtype=self.dtype))
        self._tgt.append(np.fromiter(itertools.chain.from_iterable(t for _, t in pairs), dtype=self.dtype))
        self._lens.append(np.array([(len(s), len(t)) for s, t in pairs], dtype=np.int64).reshape(-1, 2))

    def __len__(self) -> int:
        return sum(len(lens) for lens in self._lens)

    def pairs(self, order: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The pairs in ``order`` (indices in the order they were added)."""
        src = np.concatenate(self._src) if self._src else np.zeros(0, self.dtype)
        tgt = np.concatenate(self._tgt) if self._tgt else np.zeros(0, self.dtype)
        lens = np.concatenate(self._lens) if self._lens else np.zeros((0, 2), np.int64)
        starts = np.cumsum(lens, axis=0) - lens
        for i in order:
            (s0, t0), (sl, tl) = starts[i], lens[i]
            yield src[s0 : s0 + sl], tgt[t0 : t0 + tl]


def _chunks(lines: Iterator[tuple[str, str]], size: int) -> Iterator[list[tuple[str, str]]]:
    chunk: list[tuple[str, str]] = []
    for pair in lines:
        chunk.append(pair)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _read_clean(path_src: Path, path_tgt: Path) -> Iterator[tuple[str, str]]:
    with open(path_src, encoding="utf-8", newline="\n") as fs, open(path_tgt, encoding="utf-8", newline="\n") as ft:
        for s, t in zip(fs, ft):
            yield s.rstrip("\n"), t.rstrip("\n")


def _since(counts: SplitCounts, before: SplitCounts) -> SplitCounts:
    """What was counted in ``counts`` after the copy ``before`` was taken."""
    return SplitCounts(counts.read - before.read, counts.kept - before.kept, counts.rejected - before.rejected)


@dataclass(frozen=True)
class Inputs:
    """The corpora of one run, opened: ``train`` in the order they are read."""

    train: list[ParallelCorpus]
    valid: ParallelCorpus | None
    test: ParallelCorpus | None


def open_inputs(settings: PrepareSettings) -> Inputs:
    """The corpora ``settings`` names, checked as far as that needs no full read (:func:`open_corpora`)."""
    src, tgt = settings.src, settings.tgt
    train = [c for spec in settings.train for c in open_corpora(spec, src, tgt, "--train", several=True)]
    held_out = [
        None if spec is None else open_corpora(spec, src, tgt, option, several=False)[0]
        for option, spec in (("--valid", settings.valid), ("--test", settings.test))
    ]
    return Inputs(train, *held_out)


class Preparation:
    """One run of ``prepare`` of ``inputs`` into the directory ``work`` (renamed to ``final`` by the caller)."""

    def __init__(self, settings: PrepareSettings, inputs: Inputs, work: Path, final: Path) -> None:
        self.settings, self.inputs, self.work, self.final = settings, inputs, work, final
        self.src, self.tgt = settings.src, settings.tgt
        self.progress = Progress(settings.quiet)
        self.filters = settings.filters
        self.splits: dict[str, dict] = {}

    def _where(self, path: str) -> str:
        """A source path as the manifest records it: inside the output dir for generated corpora."""
        p = Path(path)
        return str(self.final / p.relative_to(self.work.resolve())) if p.is_relative_to(self.work.resolve()) else path

    def run(self) -> None:
        train, valid, test = list(self.settings.train), self.inputs.valid, self.inputs.test
        for corpus in (valid, test):  # small: check them before the long part
            if corpus is not None:
                for line in corpus:
                    reference_text(line)
        clean_src, clean_tgt = self.work / f"train.clean.{self.src}", self.work / f"train.clean.{self.tgt}"
        counts, parts, sources = self._clean_training_text(clean_src, clean_tgt)
        tokenizer = self._tokenizer(train, clean_src, clean_tgt, counts)
        self._write_training_shards(tokenizer, clean_src, clean_tgt, counts, parts, sources)
        clean_src.unlink()
        clean_tgt.unlink()
        for split, corpus in (("valid", valid), ("test", test)):
            if corpus is not None:
                self._write_reference_split(split, corpus, tokenizer)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "src_lang": self.src,
            "tgt_lang": self.tgt,
            "tokenizer": {
                **tokenizer.describe(),
                "trained": self.settings.spm is None,
                **({"source": str(Path(self.settings.spm).resolve())} if self.settings.spm else {}),
            },
            "token_dtype": str(token_dtype(tokenizer.vocab_size)),
            "filters": self.filters.to_json(),
            "seed": self.settings.seed,
            "shard_size": self.settings.shard_size,
            "note": "Only train is filtered (rejects counted by reason) and stored in a seeded random order. "
            "valid and test keep every line in order: sample i is line i+1; their raw text is in raw.src / raw.ref.",
            "splits": self.splits,
        }
        write_manifest(self.work, manifest)  # last: a directory without it is incomplete

    def _clean_training_text(
        self, clean_src: Path, clean_tgt: Path
    ) -> tuple[SplitCounts, list[SplitCounts], list[dict]]:
        """The split's counts, each corpus's (in order) and the sides read, after the text stage of filtering."""
        counts, parts, sources = SplitCounts(), [], []
        text_filter = TextFilter(self.filters, counts)
        self.progress.start()
        with open(clean_src, "w", encoding="utf-8") as fs, open(clean_tgt, "w", encoding="utf-8") as ft:
            for corpus in self.inputs.train:
                before = SplitCounts(counts.read, counts.kept, Counter(counts.rejected))
                for line in corpus:
                    pair = text_filter.accept(line)
                    if pair is not None:
                        fs.write(pair[0] + "\n")
                        ft.write(pair[1] + "\n")
                        counts.kept += 1
                    self.progress.update("train (cleaning)", counts)
                parts.append(_since(counts, before))
                sources += [dict(f.to_json(), path=self._where(f.path)) for f in corpus.files]
        return counts, parts, sources

    def _tokenizer(self, prefixes: list[str], clean_src: Path, clean_tgt: Path, counts: SplitCounts) -> Tokenizer:
        model = self.work / "spm.model"
        if self.settings.spm:
            given = Tokenizer(self.settings.spm)
            shutil.copyfile(given.path, model)
        else:
            if counts.kept == 0:
                raise DataError(
                    f"no training pair of {', '.join(prefixes)} is left after filtering ({dict(+counts.rejected)})"
                )
            started = time.monotonic()
            train_bpe(
                [clean_src, clean_tgt],
                model,
                self.settings.vocab_size,
                seed=self.settings.seed,
                max_sentences=self.settings.spm_sentences,
                character_coverage=self.settings.character_coverage,
                described_as=f"the cleaned training text of {', '.join(prefixes)}",
            )
            if not self.settings.quiet:
                LOG.info(
                    f"prepare: trained BPE with {self.settings.vocab_size} pieces in {time.monotonic() - started:.1f}s",
                    extra=STDERR,
                )
        return Tokenizer(model)

    def _length_filter(
        self,
        chunk: list[tuple[str, str]],
        ids: tuple[list, list],
        first: int,
        counts: SplitCounts,
        parts: list[tuple[int, SplitCounts]],
    ) -> tuple[list[tuple[list[int], list[int]]], list[tuple[str, str]]]:
        """The kept (ids, text) of a chunk of clean pairs whose first is clean line ``first`` (0-based); each
        reject counted for the split and for its corpus (``parts``: each corpus's counts after the one past its
        last clean line)."""
        ends = [end for end, _ in parts]
        kept, text = [], []
        for line, (pair, s, t) in enumerate(zip(chunk, *ids), start=first):
            reason = length_reject(len(s), len(t), self.filters)
            if reason:
                counts.reject(reason)
                part = parts[bisect.bisect_right(ends, line)][1]
                part.reject(reason)
                part.kept -= 1
            else:
                kept.append((s, t))
                text.append(pair)
        counts.kept += len(kept)
        return kept, text

    def _write_training_shards(
        self,
        tokenizer: Tokenizer,
        clean_src: Path,
        clean_tgt: Path,
        counts: SplitCounts,
        parts: list[SplitCounts],
        sources: list[dict],
    ) -> None:
        dtype = token_dtype(tokenizer.vocab_size)
        encoded = EncodedPairs(dtype)
        counts.kept = 0  # recounted after the length filters
        ends = list(itertools.accumulate(part.kept for part in parts))  # clean lines of each corpus: where they end
        dropout, copies = self.settings.bpe_dropout, self.settings.bpe_copies
        for index, chunk in enumerate(_chunks(_read_clean(clean_src, clean_tgt), _ENCODE_CHUNK)):
            ids = tokenizer.encode([s for s, _ in chunk]), tokenizer.encode([t for _, t in chunk])
            kept, text = self._length_filter(chunk, ids, index * _ENCODE_CHUNK, counts, list(zip(ends, parts)))
            if dropout == 0:
                encoded.add(kept)
                continue
            for copy in range(copies):
                seeds = np.random.SeedSequence([self.settings.seed, index, copy]).generate_state(2)
                sampled = zip(
                    tokenizer.encode_sampled([s for s, _ in text], dropout, int(seeds[0])),
                    tokenizer.encode_sampled([t for _, t in text], dropout, int(seeds[1])),
                )
                encoded.add(
                    [
                        (s, t) if not length_reject(len(s), len(t), self.filters) else plain
                        for (s, t), plain in zip(sampled, kept)
                    ]
                )
        if counts.kept == 0:
            raise DataError(
                f"no training pair is left after the length filters (--max-len {self.filters.max_len}, "
                f"--max-ratio {self.filters.max_ratio}): {dict(+counts.rejected)}"
            )
        self.progress.update("train", counts, final=True)
        for corpus, part in zip(self.inputs.train, parts) if len(parts) > 1 else ():
            self.progress.corpus("train", corpus.prefix, part)
        writer = ShardWriter(self.work, "train", self.settings.shard_size, dtype)
        for src, tgt in encoded.pairs(np.random.default_rng(self.settings.seed).permutation(len(encoded))):
            writer.write(src, tgt)
        self.splits["train"] = {
            "filtered": True,
            "order": "shuffled",
            **({"bpe_dropout": {"p": dropout, "copies": copies}} if dropout > 0 else {}),
            **counts.to_json(),
            "sources": sources,
            "corpora": [{"name": c.prefix, **part.to_json()} for c, part in zip(self.inputs.train, parts)],
            **writer.close(),
        }

    def _write_reference_split(self, split: str, corpus: ParallelCorpus, tokenizer: Tokenizer) -> None:
        counts = SplitCounts()
        writer = ShardWriter(self.work, split, self.settings.shard_size, token_dtype(tokenizer.vocab_size))
        raw_src, raw_ref = f"{split}.{self.src}", f"{split}.{self.tgt}"
        self.progress.start()
        with (
            open(self.work / raw_src, "w", encoding="utf-8") as fs,
            open(self.work / raw_ref, "w", encoding="utf-8") as ft,
        ):
            for chunk in _chunks((reference_text(line) for line in corpus), _ENCODE_CHUNK):
                for s, t in chunk:
                    fs.write(one_line(s) + "\n")
                    ft.write(one_line(t) + "\n")
                src_ids = tokenizer.encode([normalize(s) for s, _ in chunk])
                tgt_ids = tokenizer.encode([normalize(t) for _, t in chunk])
                for s, t in zip(src_ids, tgt_ids):
                    writer.write(s, t)
                counts.read += len(chunk)
                counts.kept += len(chunk)
                self.progress.update(split, counts)
        self.progress.update(split, counts, final=True)
        sources = [dict(f.to_json(), path=self._where(f.path)) for f in corpus.files]
        self.splits[split] = {
            "filtered": False,
            "order": "as read",
            **counts.to_json(),
            "sources": sources,
            "raw": {"src": raw_src, "ref": raw_ref},
            **writer.close(),
        }


def made_by_prepare(folder: Path) -> bool:
    """A folder written by an earlier ``prepare``: it holds a manifest.json of our format."""
    try:
        return json.loads((folder / "manifest.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def foreign_to_prepare(folder: Path) -> list[str]:
    """The names in an earlier ``prepare``'s ``folder`` that its manifest does not account for (what ``--force``
    must not delete): all of them if the manifest cannot be read."""
    names = {"manifest.json", SYNTHETIC_CORPUS}
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        names.add(manifest["tokenizer"]["file"])
        for split in manifest["splits"].values():
            names |= {s["file"] for s in split["shards"]} | {split["lengths"]["file"]}
            names |= set((split.get("raw") or {}).values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir() if p.name not in names)


def _with_synthetic_corpus(settings: PrepareSettings, folder: Path) -> PrepareSettings:
    """``settings`` reading the generated corpus of ``settings.synthetic`` pairs, written into ``folder``."""
    n = settings.synthetic
    if settings.synthetic_shape == "wmt14":  # valid and test of newstest's size
        held_out = max(1, min(3000, n // 10))
        prefixes = write_wmt_shaped_corpus(folder, n, held_out, held_out, settings.seed)
        languages = (WMT_SRC_LANG, WMT_TGT_LANG)
    else:
        held_out = max(1, min(1000, n // 10))
        prefixes = write_synthetic_corpus(folder, n, held_out, held_out, settings.seed)
        languages = (SRC_LANG, TGT_LANG)
    return replace(
        settings,
        src=languages[0],
        tgt=languages[1],
        train=(str(prefixes["train"]),),
        valid=str(prefixes["valid"]),
        test=str(prefixes["test"]),
    )


def prepare(settings: PrepareSettings, out: Path, before_commit: Callable[[], None] = lambda: None) -> float:
    """Write the prepared data of ``settings`` to the folder ``out``; the seconds it took (after any corpus generation).

    The folder is built beside ``out`` and renamed into place at the end, so it appears
    complete or not at all; an existing ``out`` is replaced then (whether it may be is the
    caller's decision). ``before_commit`` runs just before the rename: ``megaformer
    prepare`` checks there again that ``out`` holds no input.
    """
    inputs = None if settings.synthetic is not None else open_inputs(settings)  # checked before anything is written
    with atomic_output(out, replace=True) as work:
        if inputs is None:
            settings = _with_synthetic_corpus(settings, work / SYNTHETIC_CORPUS)
            inputs = open_inputs(settings)
        started = time.monotonic()
        Preparation(settings, inputs, work, out).run()
        before_commit()
    return time.monotonic() - started
