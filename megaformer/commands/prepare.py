"""``megaformer prepare``: parallel text -> cleaned pairs -> shared sentencepiece -> shards + manifest.

    megaformer prepare --src en --tgt de --train CORPUS [--train CORPUS ...]
        [--valid CORPUS] [--test CORPUS] --out DIR [--vocab-size N] [--spm MODEL] [--shard-size N]
    megaformer prepare --synthetic N --out DIR        # the built-in corpus (data/synthetic.py)
    megaformer prepare --synthetic N --synthetic-shape wmt14 --out DIR   # WMT'14 en-de's shape (data/wmt_shaped.py)

A CORPUS is one of (:mod:`megaformer.data.wmt`):

* ``PREFIX``: text files ``PREFIX.<src>`` + ``PREFIX.<tgt>`` (plain or .gz), one sentence a
  line; or, where no ``PREFIX.<src>`` exists, WMT's SGML pair ``PREFIX-src.<src>.sgm`` +
  ``PREFIX-ref.<tgt>.sgm`` (``dev/newstest2013``, ``test-full/newstest2014-deen``);
* ``ARCHIVE[:NAME]``: a WMT download as it is (``.tgz``, ``.tar.gz``, ``.tar``), read without
  extracting it: its members ``*.<a>-<b>.<src>`` + ``*.<a>-<b>.<tgt>`` (the pair named either
  way round, ``europarl-v7.de-en.en``) and SGML pairs, only those whose member path holds
  NAME if given (``dev.tgz:newstest2013``). ``--train`` takes every pair it finds, each
  counted as a corpus of its own; ``--valid`` and ``--test`` need exactly one.

Several ``--train`` are concatenated in the order given; the manifest and the summary on
stderr count read, kept and rejected pairs for each. Everything is checked that can be
without reading a corpus through (files there, archives whole, pairs found) before
anything is written, and any error leaves no ``DIR``.

The options become one :class:`megaformer.data.prepare.PrepareSettings`, written by
:func:`megaformer.data.prepare.prepare` (the steps are described there).
``--bpe-dropout P --bpe-copies K`` stores K BPE-dropout segmentations of every kept
training pair. An existing non-empty ``DIR`` is replaced only with ``--force``, and only
when an earlier prepare wrote it (its manifest.json): never a folder of other files, the
working directory, a folder above it, or a folder holding an input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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
from megaformer.data.corpus import FilterSettings
from megaformer.data.prepare import (
    SYNTHETIC_SHAPES,
    SYNTHETIC_VOCAB,
    PrepareSettings,
    foreign_to_prepare,
    made_by_prepare,
    prepare,
)
from megaformer.data.synthetic import SRC_LANG, TGT_LANG
from megaformer.data.wmt import input_path
from megaformer.errors import DataError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Four groups: input corpora, output folder, tokenizer, training-data filters."""
    defaults = DataConfig()
    _add_input_arguments(parser.add_argument_group("input"), defaults)
    _add_output_arguments(parser.add_argument_group("output"), defaults)
    _add_tokenizer_arguments(parser.add_argument_group("tokenizer"), defaults)
    _add_filter_arguments(parser.add_argument_group("training-data filters (valid/test keep every line)"), defaults)


def _add_input_arguments(data: argparse._ArgumentGroup, defaults: DataConfig) -> None:
    data.add_argument("--src", help="source language suffix (default: en; --synthetic writes its own)")
    data.add_argument("--tgt", help="target language suffix (default: de; --synthetic writes its own)")
    data.add_argument(
        "--train",
        action="append",
        default=[],
        metavar="CORPUS",
        help="training corpus: PREFIX for PREFIX.<src> + PREFIX.<tgt> (plain or .gz) or, if those are absent, WMT's "
        "SGML pair PREFIX-src.<src>.sgm + PREFIX-ref.<tgt>.sgm; or ARCHIVE[:NAME], a .tgz/.tar.gz/.tar read in place "
        "(every <src>-<tgt> pair in it: *.<src>-<tgt>.<lang> or *.<tgt>-<src>.<lang> members and SGML pairs, those "
        "whose member path holds NAME if given); repeat to concatenate corpora",
    )
    data.add_argument(
        "--valid",
        metavar="CORPUS",
        help="validation corpus, one pair: PREFIX, SGML pair PREFIX or ARCHIVE[:NAME] as for --train "
        "(e.g. dev.tgz:newstest2013; every line kept)",
    )
    data.add_argument(
        "--test",
        metavar="CORPUS",
        help="test corpus, one pair, as --valid (e.g. test-full.tgz:newstest2014; every line kept)",
    )
    data.add_argument(
        "--synthetic",
        type=positive_int,
        metavar="N",
        help=f"generate the built-in corpus with N training pairs (languages {SRC_LANG}/{TGT_LANG}) instead of --train",
    )
    data.add_argument(
        "--synthetic-shape",
        choices=SYNTHETIC_SHAPES,
        default="task",
        help="with --synthetic: 'task', the built-in translation task, or 'wmt14', a corpus with WMT'14 en-de's "
        "lengths and a 37000-piece vocabulary for speed measurements, not a language (default: %(default)s)",
    )


def _add_output_arguments(out: argparse._ArgumentGroup, defaults: DataConfig) -> None:
    out.add_argument("--out", type=new_dir, required=True, metavar="DIR", help="directory to create")
    out.add_argument("--force", action="store_true", help="replace DIR if it exists and is not empty")
    out.add_argument(
        "--shard-size",
        type=positive_int,
        default=PrepareSettings.shard_size,
        metavar="N",
        help="samples per shard (default: %(default)s)",
    )
    out.add_argument(
        "--seed",
        type=int_range(0, 2**32 - 1),
        default=defaults.seed,
        metavar="N",
        help="seed of the BPE sample, the order of training pairs in the shards and --synthetic (default: %(default)s)",
    )


def _add_tokenizer_arguments(tok: argparse._ArgumentGroup, defaults: DataConfig) -> None:
    tok.add_argument(
        "--vocab-size",
        type=int_range(8),
        metavar="N",
        help=f"shared BPE vocabulary (default: {defaults.vocab_size}; with --synthetic "
        + ", ".join(f"{n} for {shape}" for shape, n in SYNTHETIC_VOCAB.items())
        + ")",
    )
    tok.add_argument(
        "--spm", type=existing_file, metavar="MODEL", help="reuse this sentencepiece model instead of training one"
    )
    tok.add_argument(
        "--spm-sentences",
        type=nonneg_int,
        metavar="N",
        help=f"train BPE on a seeded sample of at most N sentences, 0 = all (default: {PrepareSettings.spm_sentences})",
    )
    tok.add_argument(
        "--character-coverage",
        type=finite_float(0.0, 1.0, lo_open=True),
        metavar="F",
        help=f"sentencepiece character coverage (default: {PrepareSettings.character_coverage})",
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


def _check_out(out: Path, args: argparse.Namespace) -> None:
    """DIR holds no input (``--force`` would delete it) and is new, empty, or an earlier prepare's output."""
    inputs = [("input --train", input_path(t)) for t in args.train]
    inputs += [
        ("input --valid", args.valid and input_path(args.valid)),
        ("input --test", args.test and input_path(args.test)),
    ]
    inputs.append(("input --spm", args.spm))
    refuse_output_over_inputs("--out", out, inputs, "prepared data")
    refuse_to_replace(
        "--out", out, args.force, made_by_prepare, "no manifest.json of megaformer prepare", foreign_to_prepare
    )


def settings_from_args(args: argparse.Namespace) -> PrepareSettings:
    """The run the options ask for; refuses options that do not go together."""
    if args.synthetic is not None and args.train:
        raise DataError("--synthetic generates its own corpus: do not also give --train")
    if args.synthetic is None and not args.train:
        raise DataError("give at least one --train CORPUS (or --synthetic N for the built-in corpus)")
    if args.synthetic is None and args.synthetic_shape != "task":
        raise DataError(f"--synthetic-shape {args.synthetic_shape} shapes the corpus of --synthetic N: give it too")
    if args.bpe_copies > 1 and args.bpe_dropout == 0:
        raise DataError(
            f"--bpe-copies {args.bpe_copies} without --bpe-dropout would store one segmentation "
            f"{args.bpe_copies} times: give --bpe-dropout P (0.1 is the usual value) or leave --bpe-copies out"
        )
    if args.synthetic is not None and (args.src or args.tgt):
        raise DataError("--synthetic writes its corpus in its own language suffixes: leave --src and --tgt out")
    src, tgt = args.src or "en", args.tgt or "de"
    if src == tgt:
        raise DataError(f"--src and --tgt are both {src!r}: give the two languages' file suffixes")
    if args.spm is not None:  # the model's own settings: these options would train another one
        given = [o for o, v in (("--vocab-size", args.vocab_size), ("--spm-sentences", args.spm_sentences),
                                ("--character-coverage", args.character_coverage)) if v is not None]  # fmt: skip
        if given:
            raise DataError(
                f"{', '.join(given)} {'shape' if len(given) > 1 else 'shapes'} the sentencepiece model prepare trains, "
                f"and --spm {args.spm} is reused as it is: leave {'them' if len(given) > 1 else 'it'} out"
            )
    vocab_size = args.vocab_size
    if vocab_size is None:
        vocab_size = SYNTHETIC_VOCAB[args.synthetic_shape] if args.synthetic is not None else DataConfig().vocab_size
    filters = FilterSettings(
        keep_empty=args.keep_empty,
        dedup=not args.no_dedup,
        max_len=args.max_len,
        max_ratio=args.max_ratio,
        on_bad_line=args.on_bad_line,
    )
    return PrepareSettings(
        train=tuple(args.train),
        valid=args.valid,
        test=args.test,
        synthetic=args.synthetic,
        synthetic_shape=args.synthetic_shape,
        src=src,
        tgt=tgt,
        vocab_size=vocab_size,
        spm=args.spm,
        spm_sentences=PrepareSettings.spm_sentences if args.spm_sentences is None else args.spm_sentences,
        character_coverage=args.character_coverage or PrepareSettings.character_coverage,
        bpe_dropout=args.bpe_dropout,
        bpe_copies=args.bpe_copies,
        filters=filters,
        shard_size=args.shard_size,
        seed=args.seed,
        quiet=args.quiet,
    )


def main(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    out = Path(args.out).absolute()
    _check_out(out, args)
    seconds = prepare(settings, out, before_commit=lambda: _check_out(out, args))  # again: something may have appeared
    if not settings.quiet:
        print(f"prepare: wrote {out} in {seconds:.1f}s", file=sys.stderr)
    return 0
