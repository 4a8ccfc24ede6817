"""Beam-search throughput with and without the decoder cache, on the same model and inputs.

    python benchmarks/decode.py [--json] [--device cuda]

The model is a base-like Transformer at a smaller shape (default d_model 256, d_ff
1024, 4 heads, 6 + 6 layers, vocabulary 8000, post-LN; about 10M parameters) with
random weights: throughput does not depend on what the weights learned. Every output is
forced to exactly ``--out-len`` tokens (50) + eos: the maximum length is ``out_len``
(max_len_a = 0, max_len_b = out_len) and ``min_len = out_len`` bans eos before it, so
both runs do the same number of steps on the same number of hypotheses.

Uncached search recomputes the whole prefix at every step (O(t^2) decoder work per
sentence), the cache computes one position (O(t)); the ratio grows with the length.
Both runs must produce the same hypotheses (checked and reported). Prints sentences/s
of each and their ratio (target: >= 5x at length 50); ``--json`` prints one object.
Runs in well under 2 minutes on 2 CPU cores with the defaults (about 15 s here).

``--engines N`` adds, in the same run, sentences/s of megaformer, transformers and
CTranslate2 decoding the same N Multi30k test sentences (``--data``, default
../shared/data/multi30k) with the exports of one model: Multi30k-sized (d_model 256, 3 + 3
layers), briefly trained so that outputs end, or ``--ckpt``. See
:func:`benchmarks.export_parity.engine_speeds`; needs the ``hf`` extra.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# On a shared CPU, OpenMP threads that spin at every barrier of the many small per-step
# ops make the cached run up to ~25x slower (measured); yielding avoids it. Must be set
# before torch starts OpenMP; an explicit setting in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_args import add_model_arguments, model_config, random_model  # noqa: E402

from megaformer.cli import Parser  # noqa: E402
from megaformer.cli_args import nonneg_int, positive_int  # noqa: E402
from megaformer.decode.beam import SearchSettings, beam_search  # noqa: E402
from megaformer.model import Transformer  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog="decode", description=__doc__.splitlines()[0])
    add_model_arguments(p, layers=6)
    p.add_argument("--sentences", type=positive_int, default=16)
    p.add_argument("--src-len", type=positive_int, default=25, help="source tokens per sentence, eos included")
    p.add_argument("--out-len", type=positive_int, default=50, help="output tokens per hypothesis (forced)")
    p.add_argument("--beam", type=positive_int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=nonneg_int, default=0, help="torch threads on a CPU (0: torch's default)")
    p.add_argument(
        "--engines", type=nonneg_int, default=0, help="also time megaformer, transformers, CTranslate2 on N sentences"
    )
    p.add_argument("--data", default="../shared/data/multi30k", help="Multi30k folder for --engines")
    p.add_argument("--ckpt", help="trained model for --engines (default: Multi30k-sized, briefly trained)")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def engines(args: argparse.Namespace) -> dict:
    """:func:`export_parity.engine_speeds` on ``args.engines`` sentences (beam ``args.beam``)."""
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import export_parity

    options = ["--data", args.data, "--max-new", str(args.out_len)] + (["--ckpt", args.ckpt] if args.ckpt else [])
    with tempfile.TemporaryDirectory(prefix="megaformer-engines-") as tmp:
        return export_parity.engine_speeds(export_parity.parse_args(options), args.engines, args.beam, Path(tmp))


def timed(model: Transformer, src: torch.Tensor, settings: SearchSettings, device: str) -> tuple[float, list]:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    hyps = beam_search(model, src, settings)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start, hyps


def print_engines(e: dict) -> None:
    print(f"{e['sentences']} Multi30k sentences, beam {e['beam']}, {e['threads']} threads, same model:")
    engines = [name for name in ("megaformer", "transformers", "ctranslate2") if name in e]  # no transformers: pre-LN
    for name in engines:
        print(f"  {name:13s} {e[name]['seconds']:8.2f} s  {e[name]['sentences_per_s']:8.2f} sentences/s")
    same = ", ".join(f"megaformer = {name} {e[f'identical_megaformer_{name}']}" for name in engines[1:])
    print(f"  identical outputs: {same}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = model_config(args, max(256, args.out_len + 2))
    model = random_model(cfg, args.vocab).to(args.device).eval()
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, args.vocab, (args.sentences, args.src_len), generator=g)
    src[:, -1] = 3  # eos ends every source
    src = src.to(args.device)

    forced = dict(beam=args.beam, max_len_a=0.0, max_len_b=args.out_len, min_len=args.out_len)
    beam_search(model, src[:2], SearchSettings(**{**forced, "max_len_b": 3, "min_len": 3}))  # warm-up
    beam_search(model, src[:2], SearchSettings(**{**forced, "max_len_b": 3, "min_len": 3}, use_cache=False))
    cached_s, cached = timed(model, src, SearchSettings(**forced), args.device)
    uncached_s, uncached = timed(model, src, SearchSettings(**forced, use_cache=False), args.device)

    assert all(len(h.tokens) == args.out_len for h in cached), "every hypothesis must have the forced length"
    result = {
        "shape": {
            "d_model": args.d_model,
            "d_ff": args.d_ff,
            "heads": args.heads,
            "layers": args.layers,
            "vocab": args.vocab,
            "parameters": sum(p.numel() for p in model.parameters()),
        },
        "device": args.device,
        "threads": torch.get_num_threads(),
        "sentences": args.sentences,
        "src_len": args.src_len,
        "out_len": args.out_len,
        "beam": args.beam,
        "cached": {"seconds": round(cached_s, 3), "sentences_per_s": round(args.sentences / cached_s, 3)},
        "uncached": {"seconds": round(uncached_s, 3), "sentences_per_s": round(args.sentences / uncached_s, 3)},
        "speedup": round(uncached_s / cached_s, 2),
        "identical": [h.tokens for h in cached] == [h.tokens for h in uncached],
    }
    if args.engines:
        result["engines"] = engines(args)
    if args.json:
        print(json.dumps(result))
    else:
        s = result["shape"]
        print(
            f"model d_model={s['d_model']} d_ff={s['d_ff']} heads={s['heads']} layers={s['layers']}+{s['layers']} "
            f"vocab={s['vocab']} ({s['parameters'] / 1e6:.1f}M parameters) on {args.device}, "
            f"{result['threads']} threads"
        )
        print(
            f"{args.sentences} sentences x beam {args.beam}, {args.src_len} source tokens, {args.out_len} output tokens"
        )
        print(f"cached:   {cached_s:7.2f} s  {result['cached']['sentences_per_s']:8.2f} sentences/s")
        print(f"uncached: {uncached_s:7.2f} s  {result['uncached']['sentences_per_s']:8.2f} sentences/s")
        print(f"cache speedup: {result['speedup']:.1f}x (target >= 5x); same hypotheses: {result['identical']}")
        if args.engines:
            print_engines(result["engines"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
