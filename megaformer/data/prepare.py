"""``megaformer prepare``: parallel text -> cleaned pairs -> shared sentencepiece -> shards + manifest.

    megaformer prepare --src en --tgt de --train PREFIX [--train PREFIX ...]
        [--valid PREFIX] [--test PREFIX] --out DIR [--vocab-size N] [--spm MODEL] [--shard-size N]
    megaformer prepare --synthetic N --out DIR        # the built-in corpus (data/synthetic.py)

Steps: read each corpus in step and filter the training pairs (counted by reason,
see :mod:`megaformer.data.corpus`); train one BPE model on the cleaned training text of
both sides (or reuse ``--spm``); encode; write training pairs in a seeded random order
(so that every shard is a uniform sample) and valid/test pairs in line order; write the
manifest last (format: :mod:`megaformer.data.shards`).

``--bpe-dropout P --bpe-copies K`` stores K BPE-dropout segmentations of every kept
training pair instead of its one plain segmentation (subword regularisation done once,
when the data is prepared, so streaming stays a read of token ids): the length filters
judge the plain segmentation, and a sampled one that breaks them is replaced by it.

The output is built in ``DIR.tmp-XXXX`` next to ``DIR`` and renamed into place at the
end: an interrupted run leaves no ``DIR`` (and never one with a manifest). An existing
non-empty ``DIR`` is replaced only with ``--force``, and only when an earlier prepare
wrote it (its manifest.json): never a folder of other files, the working directory, a
folder above it, or a folder holding an input. The same inputs and ``--seed`` give
byte-identical shards, tokenizer and manifest.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from megaformer.cli_args import (
    existing_file,
    finite_float,
    int_range,
    new_dir,
    nonneg_int,
    positive_int,
    refuse_output_over_inputs,
    refuse_to_replace,
)
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
from megaformer.data.shards import FORMAT, VERSION, ShardWriter, token_dtype, write_manifest
from megaformer.data.synthetic import SRC_LANG, TGT_LANG, write_synthetic_corpus
from megaformer.data.tokenizer import Tokenizer, train_bpe
from megaformer.errors import DataError
from megaformer.files import atomic_output

_ENCODE_CHUNK = 10000  # lines encoded per sentencepiece call
SYNTHETIC_VOCAB = 1000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Four groups: input corpora, output folder, tokenizer, training-data filters."""
    defaults = DataConfig()
    _add_input_arguments(parser.add_argument_group("input"), defaults)
    _add_output_arguments(parser.add_argument_group("output"), defaults)
    _add_tokenizer_arguments(parser.add_argument_group("tokenizer"), defaults)
    _add_filter_arguments(parser.add_argument_group("training-data filters (valid/test keep every line)"), defaults)


def _add_input_arguments(data: argparse._ArgumentGroup, defaults: DataConfig) -> None:
    data.add_argument("--src", default=defaults.src_lang, help="source language suffix (default: %(default)s)")
    data.add_argument("--tgt", default=defaults.tgt_lang, help="target language suffix (default: %(default)s)")
    data.add_argument(
        "--train",
        action="append",
        default=[],
        metavar="PREFIX",
        help="training corpus PREFIX.<src> / PREFIX.<tgt> (plain or .gz); repeat to concatenate corpora",
    )
    data.add_argument("--valid", metavar="PREFIX", help="validation corpus (every line kept)")
    data.add_argument("--test", metavar="PREFIX", help="test corpus (every line kept)")
    data.add_argument(
        "--synthetic",
        type=positive_int,
        metavar="N",
        help=f"generate the built-in corpus with N training pairs (languages {SRC_LANG}/{TGT_LANG}) instead of --train",
    )


def _add_output_arguments(out: argparse._ArgumentGroup, defaults: DataConfig) -> None:
    out.add_argument("--out", type=new_dir, required=True, metavar="DIR", help="directory to create")
    out.add_argument("--force", action="store_true", help="replace DIR if it exists and is not empty")
    out.add_argument(
        "--shard-size", type=positive_int, default=10000, metavar="N", help="samples per shard (default: %(default)s)"
    )
    out.add_argument(
        "--seed",
        type=int_range(0, 2**32 - 1),
        default=defaults.seed,
        metavar="N",
        help="seed of the BPE sample, the order of training pairs in the shards and --synthetic (default: %(default)s)",
    )
    out.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _add_tokenizer_arguments(tok: argparse._ArgumentGroup, defaults: DataConfig) -> None:
    tok.add_argument(
        "--vocab-size",
        type=int_range(8),
        metavar="N",
        help=f"shared BPE vocabulary (default: {defaults.vocab_size}; {SYNTHETIC_VOCAB} with --synthetic)",
    )
    tok.add_argument(
        "--spm", type=existing_file, metavar="MODEL", help="reuse this sentencepiece model instead of training one"
    )
    tok.add_argument(
        "--spm-sentences",
        type=nonneg_int,
        default=10_000_000,
        metavar="N",
        help="train BPE on a seeded sample of at most N sentences, 0 = all (default: %(default)s)",
    )
    tok.add_argument(
        "--character-coverage",
        type=finite_float(0.0, 1.0, lo_open=True),
        default=1.0,
        metavar="F",
        help="sentencepiece character coverage (default: %(default)s)",
    )
    tok.add_argument(
        "--bpe-dropout",
        type=finite_float(0.0, 1.0, hi_open=True),
        default=0.0,
        metavar="P",
        help="segment the training pairs with BPE-dropout P (each merge skipped with probability P; "
        "valid and test keep the plain segmentation), 0 = off (default: %(default)s)",
    )
    tok.add_argument(
        "--bpe-copies",
        type=int_range(1, 1000),
        default=1,
        metavar="K",
        help="with --bpe-dropout: store K sampled segmentations of every training pair (default: %(default)s)",
    )


def _add_filter_arguments(filt: argparse._ArgumentGroup, defaults: DataConfig) -> None:
    filt.add_argument(
        "--max-len",
        type=nonneg_int,
        default=defaults.max_len,
        metavar="N",
        help="drop pairs with more than N tokens on a side, 0 = no limit (default: %(default)s)",
    )
    filt.add_argument(
        "--max-ratio",
        type=finite_float(0.0),
        default=9.0,
        metavar="R",
        help="drop pairs whose longer side has over R times the tokens of the shorter, 0 = off (default: %(default)s)",
    )
    filt.add_argument("--no-dedup", action="store_true", help="keep exact duplicate pairs")
    filt.add_argument("--keep-empty", action="store_true", help="keep pairs with an empty side")
    filt.add_argument(
        "--on-bad-line",
        choices=("reject", "error"),
        default="reject",
        help="a training line that is not UTF-8: count it as a reject, or stop (default: %(default)s)",
    )


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
        print(
            f"prepare {what}: read {counts.read:,} kept {counts.kept:,} ({rate:,.0f} lines/s)"
            + ("" if not final else f" rejected {dict(+counts.rejected) or 'none'}"),
            file=sys.stderr,
            flush=True,
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


class Preparation:
    """One run of ``prepare`` into the directory ``work`` (renamed to ``final`` by the caller)."""

    def __init__(self, args: argparse.Namespace, work: Path, final: Path) -> None:
        self.args, self.work, self.final = args, work, final
        self.src, self.tgt = args.src, args.tgt
        self.progress = Progress(args.quiet)
        self.filters = FilterSettings(
            keep_empty=args.keep_empty,
            dedup=not args.no_dedup,
            max_len=args.max_len,
            max_ratio=args.max_ratio,
            on_bad_line=args.on_bad_line,
        )
        self.splits: dict[str, dict] = {}

    def _where(self, path: str) -> str:
        """A source path as the manifest records it: inside the output dir for generated corpora."""
        p = Path(path)
        return str(self.final / p.relative_to(self.work.resolve())) if p.is_relative_to(self.work.resolve()) else path

    def run(self, train: list[str], valid: str | None, test: str | None) -> None:
        for prefix in (valid, test):  # small: check them before the long part
            if prefix is not None:
                for line in ParallelCorpus(prefix, self.src, self.tgt):
                    reference_text(line)
        clean_src, clean_tgt = self.work / f"train.clean.{self.src}", self.work / f"train.clean.{self.tgt}"
        counts, sources = self._clean_training_text(train, clean_src, clean_tgt)
        tokenizer = self._tokenizer(train, clean_src, clean_tgt, counts)
        self._write_training_shards(tokenizer, clean_src, clean_tgt, counts, sources)
        clean_src.unlink()
        clean_tgt.unlink()
        for split, prefix in (("valid", valid), ("test", test)):
            if prefix is not None:
                self._write_reference_split(split, prefix, tokenizer)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "src_lang": self.src,
            "tgt_lang": self.tgt,
            "tokenizer": {
                **tokenizer.describe(),
                "trained": self.args.spm is None,
                **({"source": str(Path(self.args.spm).resolve())} if self.args.spm else {}),
            },
            "token_dtype": str(token_dtype(tokenizer.vocab_size)),
            "filters": self.filters.to_json(),
            "seed": self.args.seed,
            "shard_size": self.args.shard_size,
            "note": "Only train is filtered (rejects counted by reason) and stored in a seeded random order. "
            "valid and test keep every line in order: sample i is line i+1; their raw text is in raw.src / raw.ref.",
            "splits": self.splits,
        }
        write_manifest(self.work, manifest)  # last: a directory without it is incomplete

    def _clean_training_text(
        self, prefixes: list[str], clean_src: Path, clean_tgt: Path
    ) -> tuple[SplitCounts, list[dict]]:
        counts, sources = SplitCounts(), []
        text_filter = TextFilter(self.filters, counts)
        self.progress.start()
        with open(clean_src, "w", encoding="utf-8") as fs, open(clean_tgt, "w", encoding="utf-8") as ft:
            for prefix in prefixes:
                corpus = ParallelCorpus(prefix, self.src, self.tgt)
                for line in corpus:
                    pair = text_filter.accept(line)
                    if pair is not None:
                        fs.write(pair[0] + "\n")
                        ft.write(pair[1] + "\n")
                        counts.kept += 1
                    self.progress.update("train (cleaning)", counts)
                sources += [dict(f.to_json(), path=self._where(f.path)) for f in corpus.files]
        return counts, sources

    def _tokenizer(self, prefixes: list[str], clean_src: Path, clean_tgt: Path, counts: SplitCounts) -> Tokenizer:
        model = self.work / "spm.model"
        if self.args.spm:
            given = Tokenizer(self.args.spm)
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
                self.args.vocab_size,
                seed=self.args.seed,
                max_sentences=self.args.spm_sentences,
                character_coverage=self.args.character_coverage,
                described_as=f"the cleaned training text of {', '.join(prefixes)}",
            )
            if not self.args.quiet:
                print(
                    f"prepare: trained BPE with {self.args.vocab_size} pieces in {time.monotonic() - started:.1f}s",
                    file=sys.stderr,
                    flush=True,
                )
        return Tokenizer(model)

    def _write_training_shards(
        self, tokenizer: Tokenizer, clean_src: Path, clean_tgt: Path, counts: SplitCounts, sources: list[dict]
    ) -> None:
        dtype = token_dtype(tokenizer.vocab_size)
        encoded = EncodedPairs(dtype)
        counts.kept = 0  # recounted after the length filters
        dropout, copies = self.args.bpe_dropout, self.args.bpe_copies
        for index, chunk in enumerate(_chunks(_read_clean(clean_src, clean_tgt), _ENCODE_CHUNK)):
            src_ids = tokenizer.encode([s for s, _ in chunk])
            tgt_ids = tokenizer.encode([t for _, t in chunk])
            kept, text = [], []
            for pair, s, t in zip(chunk, src_ids, tgt_ids):
                reason = length_reject(len(s), len(t), self.filters)
                if reason:
                    counts.reject(reason)
                else:
                    kept.append((s, t))
                    text.append(pair)
            counts.kept += len(kept)
            if dropout == 0:
                encoded.add(kept)
                continue
            for copy in range(copies):
                seeds = np.random.SeedSequence([self.args.seed, index, copy]).generate_state(2)
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
        writer = ShardWriter(self.work, "train", self.args.shard_size, dtype)
        for src, tgt in encoded.pairs(np.random.default_rng(self.args.seed).permutation(len(encoded))):
            writer.write(src, tgt)
        self.splits["train"] = {
            "filtered": True,
            "order": "shuffled",
            **({"bpe_dropout": {"p": dropout, "copies": copies}} if dropout > 0 else {}),
            **counts.to_json(),
            "sources": sources,
            **writer.close(),
        }

    def _write_reference_split(self, split: str, prefix: str, tokenizer: Tokenizer) -> None:
        counts = SplitCounts()
        corpus = ParallelCorpus(prefix, self.src, self.tgt)
        writer = ShardWriter(self.work, split, self.args.shard_size, token_dtype(tokenizer.vocab_size))
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


def _made_by_prepare(folder: Path) -> bool:
    """A folder written by an earlier ``prepare``: it holds a manifest.json of our format."""
    try:
        return json.loads((folder / "manifest.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _check_out(out: Path, args: argparse.Namespace) -> None:
    """DIR holds no input (``--force`` would delete it) and is new, empty, or an earlier prepare's output."""
    inputs = [("input --train", t) for t in args.train]
    inputs += [("input --valid", args.valid), ("input --test", args.test), ("input --spm", args.spm)]
    refuse_output_over_inputs("--out", out, inputs, "prepared data")
    refuse_to_replace("--out", out, args.force, _made_by_prepare, "no manifest.json of megaformer prepare")


def main(args: argparse.Namespace) -> int:
    if args.synthetic is not None and args.train:
        raise DataError("--synthetic generates its own corpus: do not also give --train")
    if args.synthetic is None and not args.train:
        raise DataError("give at least one --train PREFIX (or --synthetic N for the built-in corpus)")
    if args.vocab_size is None:
        args.vocab_size = SYNTHETIC_VOCAB if args.synthetic is not None else DataConfig().vocab_size
    if args.bpe_copies > 1 and args.bpe_dropout == 0:
        raise DataError(
            f"--bpe-copies {args.bpe_copies} without --bpe-dropout would store one segmentation "
            f"{args.bpe_copies} times: give --bpe-dropout P (0.1 is the usual value) or leave --bpe-copies out"
        )
    out = Path(args.out).absolute()
    _check_out(out, args)
    with atomic_output(out, replace=True) as work:  # the folder appears complete, or not at all
        train, valid, test = args.train, args.valid, args.test
        if args.synthetic is not None:
            args.src, args.tgt = SRC_LANG, TGT_LANG
            held_out = max(1, min(1000, args.synthetic // 10))
            prefixes = write_synthetic_corpus(work / "corpus", args.synthetic, held_out, held_out, args.seed)
            train, valid, test = [str(prefixes["train"])], str(prefixes["valid"]), str(prefixes["test"])
        started = time.monotonic()
        Preparation(args, work, out).run(train, valid, test)
        _check_out(out, args)  # again: something may have appeared meanwhile
    if not args.quiet:
        print(f"prepare: wrote {out} in {time.monotonic() - started:.1f}s", file=sys.stderr)
    return 0
