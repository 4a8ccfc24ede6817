"""``megaformer evaluate``: translate a test set and score it with sacreBLEU (BLEU and chrF), or score a given output.

``--ckpt M --input SRC --ref REF`` translates SRC and scores it; ``--hyp HYP --ref REF``
scores HYP as it is (as ``sacrebleu REF < HYP`` would), without a model.

Prints sacreBLEU's lines with their signatures: cased BLEU (sacreBLEU's default, what
the WMT results are compared with), lowercased BLEU (``-lc``, 13a: what Multi30k papers
report) and chrF, each line saying which it is; then the paper's metric, tokenized
compound-split BLEU (:func:`megaformer.decode.evaluate.tokenized_bleu`), formatted as
multi-bleu.perl prints it. With ``--json``, one object with the keys ``bleu`` (cased),
``signature``, ``bleu_lc``, ``signature_lc``, ``chrf``, ``chrf_signature``,
``bleu_tokenized``, ``signature_tokenized``, ``sentences``, and either ``hyp`` (the file
scored) or ``seconds`` (time spent searching), ``checkpoint`` (the file or step directory
scored), ``step`` and the search settings. ``--output`` keeps the hypotheses.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import stat
from pathlib import Path

from sacrebleu.metrics import BLEU

from megaformer.cli_args import existing_file, new_file, refuse_output_over_inputs
from megaformer.commands.translate import add_search_arguments, max_tokens_from_args, settings_from_args
from megaformer.decode.evaluate import Scores, TokenizedBleu, corpus_scores, moses_languages, tokenized_bleu
from megaformer.decode.translate import open_model, read_text_lines, translate_text, write_lines
from megaformer.errors import ConfigError, DataError

# What only translating needs: with --hyp none of them may be given (--tp: other than its default 1).
DECODING_OPTIONS = ("ckpt", "input", "output", "beam", "lenpen", "max_len_a", "max_len_b", "max_tokens")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--input", type=existing_file, help="source sentences to translate with --ckpt, one a line (raw, plain or .gz)"
    )
    parser.add_argument(
        "--ref", type=existing_file, help="reference translations, one a line (plain or .gz); always needed"
    )
    parser.add_argument(
        "--hyp",
        type=existing_file,
        help="score these translations, one a line (detokenized, plain or .gz), instead of translating: "
        "no --ckpt, --input or search options",
    )
    parser.add_argument("--output", type=new_file, help="write the hypotheses here (gzip if it ends in .gz)")
    parser.add_argument(
        "--tokenize",
        default="13a",
        choices=sorted(BLEU.TOKENIZERS),
        help="sacreBLEU tokenizer (default 13a; zh, ja-mecab, intl ...)",
    )
    parser.add_argument(
        "--lang",
        choices=moses_languages(),
        metavar="LANG",
        help="target language for the Moses tokenizer of the tokenized BLEU (default: the checkpoint's "
        "data.tgt_lang, else the --ref file's suffix as in newstest2014.de or test.de.gz, else en, "
        "tokenizer.perl's own default)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_search_arguments(parser, ckpt_required=False)


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


def check_mode(args: argparse.Namespace) -> None:
    """Either ``--ckpt --input --ref`` (translate, then score) or ``--hyp --ref`` (score a given output)."""
    if args.hyp is None:
        missing = [f"--{name}" for name in ("ckpt", "input", "ref") if getattr(args, name) is None]
        if missing:
            raise ConfigError(
                f"{' and '.join(missing)} missing: evaluate needs --ckpt, --input and --ref (translate, then score) "
                f"or --hyp and --ref (score a given output)"
            )
        return
    given = [f"--{name.replace('_', '-')}" for name in DECODING_OPTIONS if getattr(args, name) is not None]
    given += ["--tp"] if args.tp != 1 else []
    if given:
        raise ConfigError(
            f"--hyp with {', '.join(given)}: --hyp scores a given output, these options translate --input; "
            f"give one or the other"
        )
    if args.ref is None:
        raise ConfigError("--hyp needs --ref: the reference translations to score it against")


def read_pair(option: str, path: str, ref: str) -> tuple[list[str], list[str]]:
    """The lines of ``path`` (``--input`` or ``--hyp``) and of the references: as many, and not none."""
    if one_stream(str(path), str(ref)):
        raise DataError(
            f"{option} {path} and --ref {ref}: one stream (standard input or a pipe) can feed only one of "
            f"them; give the other as a file"
        )
    lines, references = read_text_lines(path), read_text_lines(ref)
    if len(lines) != len(references):
        raise DataError(f"{path} has {len(lines)} lines but {ref} has {len(references)}")
    if not lines:
        raise DataError(f"{path} and {ref} hold no sentences: nothing to score")
    return lines, references


def target_language(lang: str | None, model_lang: str, ref: str) -> str:
    """``--lang``, else the checkpoint's target language, else the --ref file's suffix (``newstest2014.de``,
    ``test.de.gz``), else tokenizer.perl's default ``en``; a name the Moses tokenizer does not know is passed over."""
    name = Path(str(ref)).name.removesuffix(".gz")
    suffix = name.rsplit(".", 1)[1] if "." in name else ""
    known = moses_languages()
    return lang or next((x for x in (model_lang, suffix) if x in known), "en")


def score(hypotheses: list[str], references: list[str], tokenize: str, lang: str) -> tuple[Scores, TokenizedBleu]:
    try:
        scores = corpus_scores(hypotheses, references, tokenize)
    except (KeyError, ValueError) as err:  # sacreBLEU rejects an unknown tokenizer
        raise DataError(f"--tokenize {tokenize}: {err}") from None
    return scores, tokenized_bleu(hypotheses, references, lang)


def report(scores: Scores, tok: TokenizedBleu, as_json: bool, more: dict) -> None:
    """sacreBLEU's three lines and the tokenized BLEU's, or one JSON object with ``more`` at its end."""
    if as_json:
        result = {
            "bleu": round(scores.bleu, 4),
            "signature": scores.bleu_signature,
            "bleu_lc": round(scores.bleu_lc, 4),
            "signature_lc": scores.bleu_lc_signature,
            "chrf": round(scores.chrf, 4),
            "chrf_signature": scores.chrf_signature,
            "bleu_tokenized": round(tok.bleu, 4),
            "signature_tokenized": tok.signature,
            **more,
        }
        print(json.dumps(result, allow_nan=False))
        return
    print(f"{scores.bleu_text}   (cased BLEU)")
    print(f"{scores.bleu_lc_text}   (lowercased BLEU, as Multi30k papers report)")
    print(scores.chrf_text)
    print(
        f"tokenized compound-split {tok.text}   (Moses tokenizer -l {tok.lang}, ##AT## hyphen split, "
        f"multi-bleu.perl: the paper's EN-DE metric)"
    )


def score_given(args: argparse.Namespace) -> int:
    """``--hyp`` against ``--ref``, no model."""
    check_tokenizer(args.tokenize)
    hypotheses, references = read_pair("--hyp", args.hyp, args.ref)
    lang = target_language(args.lang, "", args.ref)
    scores, tok = score(hypotheses, references, args.tokenize, lang)
    report(scores, tok, args.json, {"sentences": len(hypotheses), "hyp": str(args.hyp)})
    return 0


def main(args: argparse.Namespace) -> int:
    check_mode(args)
    if args.hyp is not None:
        return score_given(args)
    if args.json and args.output is not None and str(args.output) == "-":
        raise DataError(
            "--output - with --json: the hypotheses and the JSON object would share stdout; "
            "write the hypotheses to a file"
        )
    inputs = [("--input file", args.input), ("--ref file", args.ref)]
    refuse_output_over_inputs("--output", args.output, inputs, "hypotheses")  # not the test set they are scored on
    check_tokenizer(args.tokenize)
    sources, references = read_pair("--input", args.input, args.ref)
    model, ckpt = open_model(args.ckpt, "evaluate")
    refuse_output_over_inputs("--output", args.output, [("checkpoint", ckpt)], "hypotheses")
    settings = settings_from_args(args, model)
    lang = target_language(args.lang, model.config.data.tgt_lang, args.ref)
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
    scores, tok = score(hypotheses, references, args.tokenize, lang)
    more = {
        "sentences": len(sources),
        "seconds": round(seconds, 3),
        "checkpoint": str(ckpt),
        "step": model.meta.get("step"),
        "settings": {k: v for k, v in dataclasses.asdict(settings).items() if k != "use_cache"},
    }
    report(scores, tok, args.json, more)
    return 0
