"""``megaformer evaluate``: translate a test set and score it with sacreBLEU (BLEU and chrF).

Prints sacreBLEU's lines with their signatures, or with ``--json`` one object with the
keys ``bleu``, ``chrf``, ``signature`` (BLEU's), ``chrf_signature``, ``sentences``,
``seconds`` (time spent searching) and the search settings. ``--out`` keeps the
hypotheses.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from megaformer.decode.evaluate import corpus_scores
from megaformer.decode.loading import load_model_file
from megaformer.decode.translate import (
    add_search_arguments,
    read_lines,
    settings_from_args,
    translate_text,
    write_lines,
)
from megaformer.errors import DataError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--src", required=True, help="source sentences, one a line (raw text)")
    parser.add_argument("--ref", required=True, help="reference translations, one a line (raw text)")
    parser.add_argument("--out", help="write the hypotheses here")
    parser.add_argument("--tokenize", default="13a", help="sacreBLEU tokenizer (default 13a; zh, ja-mecab, intl ...)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_search_arguments(parser)


def main(args: argparse.Namespace) -> int:
    sources, references = read_lines(args.src), read_lines(args.ref)
    if len(sources) != len(references):
        raise DataError(f"{args.src} has {len(sources)} lines but {args.ref} has {len(references)}")
    model = load_model_file(args.ckpt)
    settings = settings_from_args(args, model)
    hypotheses, seconds = translate_text(
        args.ckpt, model, sources, settings, max_tokens=args.max_tokens, tp=args.tp, quiet=args.quiet, source=args.src
    )
    if args.out:
        write_lines(args.out, hypotheses)
    try:
        scores = corpus_scores(hypotheses, references, args.tokenize)
    except (KeyError, ValueError) as err:  # sacreBLEU rejects an unknown tokenizer
        raise DataError(f"--tokenize {args.tokenize}: {err}") from None
    if args.json:
        print(
            json.dumps(
                {
                    "bleu": round(scores.bleu, 4),
                    "chrf": round(scores.chrf, 4),
                    "signature": scores.bleu_signature,
                    "chrf_signature": scores.chrf_signature,
                    "sentences": len(sources),
                    "seconds": round(seconds, 3),
                    "settings": {k: v for k, v in dataclasses.asdict(settings).items() if k != "use_cache"},
                }
            )
        )
    else:
        print(scores.bleu_text)
        print(scores.chrf_text)
    return 0
