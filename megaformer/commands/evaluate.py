"""``megaformer evaluate``: translate a test set and score it with sacreBLEU (BLEU and chrF).

Prints sacreBLEU's lines with their signatures: cased BLEU (sacreBLEU's default, what
the WMT results are compared with), lowercased BLEU (``-lc``, 13a: what Multi30k papers
report) and chrF, each line saying which it is. With ``--json``, one object with the
keys ``bleu`` (cased), ``signature``, ``bleu_lc``, ``signature_lc``, ``chrf``,
``chrf_signature``, ``sentences``, ``seconds`` (time spent searching), ``checkpoint``
(the file or step directory scored) and ``step``, and the search settings.
``--output`` keeps the hypotheses.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import stat

from sacrebleu.metrics import BLEU

from megaformer.cli_args import existing_file, new_file, refuse_output_over_inputs
from megaformer.commands.translate import add_search_arguments, max_tokens_from_args, settings_from_args
from megaformer.decode.evaluate import corpus_scores
from megaformer.decode.translate import open_model, read_text_lines, translate_text, write_lines
from megaformer.errors import ConfigError, DataError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--input", type=existing_file, required=True, help="source sentences, one a line (raw text, plain or .gz)"
    )
    parser.add_argument(
        "--ref", type=existing_file, required=True, help="reference translations, one a line (plain or .gz)"
    )
    parser.add_argument("--output", type=new_file, help="write the hypotheses here (gzip if it ends in .gz)")
    parser.add_argument(
        "--tokenize",
        default="13a",
        choices=sorted(BLEU.TOKENIZERS),
        help="sacreBLEU tokenizer (default 13a; zh, ja-mecab, intl ...)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_search_arguments(parser)


def check_tokenizer(name: str) -> None:
    """Build sacreBLEU's ``name`` tokenizer now, before any decoding: some need MeCab or a download.

    ja-mecab and ko-mecab need extra packages; flores101, flores200, spBLEU-1K and spm
    download a sentencepiece model on first use. sacreBLEU's own warnings are held back,
    so a refusal is one line.
    """
    logger = logging.getLogger("sacrebleu")
    level = logger.level
    logger.setLevel(logging.ERROR + 10)
    try:
        BLEU(tokenize=name)
    except Exception as err:  # ImportError/RuntimeError (MeCab), URLError/OSError (download)
        reason = " ".join(str(err).split()) or type(err).__name__
        raise ConfigError(
            f"--tokenize {name}: sacreBLEU cannot build this tokenizer ({type(err).__name__}: {reason}); "
            f"install what it needs (or fetch its model where the network is reachable) or choose another, "
            f"e.g. --tokenize 13a"
        ) from None
    finally:
        logger.setLevel(level)


def one_stream(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` would read one stream: ``-`` twice, or standard input, a pipe or a terminal under
    two names (``-`` and ``/dev/stdin``, ``/dev/fd/0``, a FIFO given twice). The first to read would take it all.
    A regular file under two names is two reads of it, which is fine."""
    if a == b == "-":
        return True
    try:
        first, second = (os.fstat(0) if path == "-" else os.stat(path) for path in (a, b))
    except OSError:
        return False
    return (first.st_dev, first.st_ino) == (second.st_dev, second.st_ino) and not stat.S_ISREG(first.st_mode)


def main(args: argparse.Namespace) -> int:
    if one_stream(str(args.input), str(args.ref)):
        raise DataError(
            f"--input {args.input} and --ref {args.ref}: one stream (standard input or a pipe) can feed only one of "
            f"them; give the other as a file"
        )
    if args.json and args.output is not None and str(args.output) == "-":
        raise DataError(
            "--output - with --json: the hypotheses and the JSON object would share stdout; "
            "write the hypotheses to a file"
        )
    inputs = [("--input file", args.input), ("--ref file", args.ref)]
    refuse_output_over_inputs("--output", args.output, inputs, "hypotheses")  # not the test set they are scored on
    check_tokenizer(args.tokenize)
    sources, references = read_text_lines(args.input), read_text_lines(args.ref)
    if len(sources) != len(references):
        raise DataError(f"{args.input} has {len(sources)} lines but {args.ref} has {len(references)}")
    if not sources:
        raise DataError(f"{args.input} and {args.ref} hold no sentences: nothing to score")
    model, ckpt = open_model(args.ckpt, "evaluate")
    refuse_output_over_inputs("--output", args.output, [("checkpoint", ckpt)], "hypotheses")
    settings = settings_from_args(args, model)
    hypotheses, seconds = translate_text(
        ckpt,
        model,
        sources,
        settings,
        max_tokens=max_tokens_from_args(args, model),
        tp=args.tp,
        quiet=args.quiet,
        source=args.input,
    )
    if args.output:
        write_lines(args.output, hypotheses)
    try:
        scores = corpus_scores(hypotheses, references, args.tokenize)
    except (KeyError, ValueError) as err:  # sacreBLEU rejects an unknown tokenizer
        raise DataError(f"--tokenize {args.tokenize}: {err}") from None
    if args.json:
        result = {
            "bleu": round(scores.bleu, 4),
            "signature": scores.bleu_signature,
            "bleu_lc": round(scores.bleu_lc, 4),
            "signature_lc": scores.bleu_lc_signature,
            "chrf": round(scores.chrf, 4),
            "chrf_signature": scores.chrf_signature,
            "sentences": len(sources),
            "seconds": round(seconds, 3),
            "checkpoint": str(ckpt),
            "step": model.meta.get("step"),
            "settings": {k: v for k, v in dataclasses.asdict(settings).items() if k != "use_cache"},
        }
        print(json.dumps(result, allow_nan=False))
    else:
        print(f"{scores.bleu_text}   (cased BLEU)")
        print(f"{scores.bleu_lc_text}   (lowercased BLEU, as Multi30k papers report)")
        print(scores.chrf_text)
    return 0
