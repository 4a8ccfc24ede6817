"""``megaformer inspect DIR``: what a prepared directory holds, and how well it batches.

Per split: lines read, kept and rejected by reason, samples, tokens, shards; a histogram
of token lengths; the share of padding in the batches the training stream would build
for one epoch at ``--max-tokens`` (:func:`megaformer.data.summary.summarize`).
``--json`` prints the same as one JSON object (keys per split include ``read``,
``kept``, ``rejected`` and ``padding_waste``). ``--verify`` also reads every shard
through and checks its sample count, sha256, token ids and lengths; ``--spm MODEL``
checks that the data was made with that tokenizer.
"""

from __future__ import annotations

import argparse
import json

from megaformer.cli_args import existing_file, existing_path, positive_int
from megaformer.config import DataConfig
from megaformer.data.summary import summarize
from megaformer.errors import DataError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = DataConfig()
    parser.add_argument("dir", type=existing_path, metavar="DIR", help="a directory written by megaformer prepare")
    parser.add_argument(
        "--max-tokens",
        type=positive_int,
        default=defaults.max_tokens,
        metavar="N",
        help="tokens per batch and side, with padding (default: %(default)s)",
    )
    parser.add_argument(
        "--sort-buffer",
        type=positive_int,
        default=defaults.sort_buffer,
        metavar="N",
        help="samples sorted by length together (default: %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a report")
    parser.add_argument("--verify", action="store_true", help="also read every shard and check its samples and sha256")
    parser.add_argument(
        "--spm", type=existing_file, metavar="MODEL", help="check that the data was made with this sentencepiece model"
    )


def report(summary: dict) -> str:
    """The text report of a :func:`summarize` dict: a table of the splits, then each split's length histogram."""
    tok = summary["tokenizer"]
    lines = [
        f"{summary['dir']}: {summary['src_lang']} -> {summary['tgt_lang']}, tokenizer {tok['file']} "
        f"({tok['vocab_size']} pieces, sha256 {tok['sha256'][:12]})",
        "",
    ]
    lines.append(
        f"{'split':<6} {'read':>9} {'kept':>9} {'samples':>9} {'src tok':>10} {'tgt tok':>10} {'shards':>6} "
        f"{'batches':>7} {'padding':>8}  rejected"
    )
    for name, s in summary["splits"].items():
        rejected = ", ".join(f"{k} {v}" for k, v in s["rejected"].items() if v) or "none"
        lines.append(
            f"{name:<6} {s['read']:>9,} {s['kept']:>9,} {s['samples']:>9,} {s['src_tokens'] or 0:>10,} "
            f"{s['tgt_tokens'] or 0:>10,} {s['shards']:>6} {s['batches']:>7} {s['padding_waste']:>8.2%}  {rejected}"
        )
    lines.append(
        f"(padding: share of padded slots, both sides, in one epoch of batches of <= {summary['max_tokens']} tokens)"
    )
    for name, s in summary["splits"].items():
        hist = s["length_histogram"]
        peak = max(max(hist["src"]), max(hist["tgt"]), 1)
        lines += ["", f"{name}: tokens per sentence (without eos)     source | target"]
        for i, (a, b) in enumerate(zip(hist["src"], hist["tgt"])):
            lo = i * hist["bin_width"]
            bar = lambda n, peak=peak: "#" * round(30 * n / peak)
            lines.append(f"  {lo:>4}-{lo + hist['bin_width'] - 1:<4} {a:>8,} {bar(a):<30} | {b:>8,} {bar(b)}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise DataError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    summary = summarize(args.dir, args.max_tokens, args.sort_buffer, args.verify, args.spm)
    print(json.dumps(summary, indent=1) if args.json else report(summary))
    if args.verify and not args.json:  # a failure is an error line instead; say that the reading happened
        shards = sum(s["shards"] for s in summary["splits"].values())
        samples = sum(s["samples"] for s in summary["splits"].values())
        print(
            f"\nverified: {shards} shard{'s' * (shards != 1)} read, {samples:,} samples and sha256 as the manifest says"
        )
    return 0
