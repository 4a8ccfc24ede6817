"""``megaformer translate``: raw text in, detokenized translations out, in input order.

Reads ``--input`` (stdin by default), translates it with :func:`megaformer.decode.translate.translate_text`
and writes ``--output`` (stdout by default). The search options shared with ``evaluate``
(:func:`add_search_arguments`) default to the checkpoint's ``decode.*``. ``--tp N`` > 1
decodes with N local processes; bad input fails before any process starts.
"""

from __future__ import annotations

import argparse

from megaformer.checkpoint import Consolidated
from megaformer.cli_args import (
    existing_file,
    existing_path,
    finite_float,
    int_range,
    new_file,
    positive_int,
    refuse_output_over_inputs,
)
from megaformer.config import RANGES
from megaformer.decode.beam import SearchSettings
from megaformer.decode.translate import open_model, read_text_lines, translate_text, write_lines
from megaformer.errors import ConfigError

# The search options' bounds are the config's (decode.max_len_a, decode.max_len_b): beyond them
# a * n + b no longer fits an int64, and the output is capped at model.max_positions - 1 anyway.
MAX_LEN_A, MAX_LEN_B = RANGES[("decode", "max_len_a")][1], RANGES[("decode", "max_len_b")][1]


def add_search_arguments(parser: argparse.ArgumentParser, ckpt_required: bool = True) -> None:
    """Options shared by ``translate`` and ``evaluate``; unset ones come from the checkpoint's config.

    ``ckpt_required=False``: the command checks ``--ckpt`` itself (``evaluate --hyp`` scores without a model).
    """
    parser.add_argument(
        "--ckpt",
        type=existing_path,
        required=ckpt_required,
        help="model file, checkpoint step directory, or run directory (its newest complete checkpoint)",
    )
    parser.add_argument(
        "--beam", type=positive_int, help="beam size (default: the checkpoint's decode.beam, the paper's 4)"
    )
    parser.add_argument(
        "--lenpen", type=finite_float(0.0), help="length penalty alpha >= 0 (default: decode.lenpen, the paper's 0.6)"
    )
    parser.add_argument(
        "--max-len-a",
        type=finite_float(0.0, MAX_LEN_A),
        help="at most a * source length + b output tokens, and never more than model.max_positions - 1 "
        "(default: decode.max_len_a)",
    )
    parser.add_argument("--max-len-b", type=int_range(0, MAX_LEN_B), help="(default: decode.max_len_b)")
    parser.add_argument(
        "--max-tokens",
        type=positive_int,
        help="source tokens per decoding batch, padding included (default: decode.max_tokens, 4096)",
    )
    parser.add_argument(
        "--tp", type=positive_int, default=1, help="tensor-parallel processes to decode with (default 1)"
    )


def max_tokens_from_args(args: argparse.Namespace, model: Consolidated) -> int:
    """``--max-tokens``, else the checkpoint's ``decode.max_tokens``: every search option defaults to decode.*."""
    return args.max_tokens if args.max_tokens is not None else model.config.decode.max_tokens


def settings_from_args(args: argparse.Namespace, model: Consolidated) -> SearchSettings:
    """The search the options ask for; an option left out takes the checkpoint's ``decode.*``."""
    try:
        return SearchSettings.from_config(
            model.config.decode, beam=args.beam, lenpen=args.lenpen, max_len_a=args.max_len_a, max_len_b=args.max_len_b
        )
    except ValueError as err:
        raise ConfigError(str(err)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--input", type=existing_file, help="text to translate, one sentence a line, plain or .gz (default: stdin)"
    )
    parser.add_argument(
        "--output", type=new_file, help="where the translations go, gzip if it ends in .gz (default: stdout)"
    )
    add_search_arguments(parser)


def main(args: argparse.Namespace) -> int:
    refuse_output_over_inputs("--output", args.output, [("--input file", args.input)], "translations")
    lines = read_text_lines(args.input)
    model, ckpt = open_model(args.ckpt, "translate")
    refuse_output_over_inputs("--output", args.output, [("checkpoint", ckpt)], "translations")
    out, _ = translate_text(
        ckpt,
        model,
        lines,
        settings_from_args(args, model),
        max_tokens=max_tokens_from_args(args, model),
        tp=args.tp,
        quiet=args.quiet,
        source=args.input or "stdin",
    )
    write_lines(args.output, out)
    return 0
