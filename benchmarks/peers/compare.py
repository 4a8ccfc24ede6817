"""megaformer against fairseq and OpenNMT-py on Multi30k en->de: the same data, model, recipe and scoring (run.sh).

    python benchmarks/peers/compare.py --minutes M [--systems "fairseq opennmt megaformer"] [--precisions "fp32 bf16"]
        [--data DIR] [--work DIR] [--peers DIR] [--plot PNG]

What every system shares: ``megaformer prepare``'s cleaned pairs and 8,000-piece sentencepiece model (the peers
read the prepared shards back as pieces: byte-for-byte the same segmentation, nothing re-cleaned), the model of
``configs/multi30k.yaml``, and megaformer's current recipe for the machine and minutes
(:func:`megaformer.recipes.multi30k.choose`, fp32: no peer trains in bf16 on a CPU), mapped onto each toolkit's
options (:mod:`peer_fairseq`, :mod:`peer_opennmt`; what a toolkit cannot express is said there). Each system
trains for the minutes, averages its last 5 saves (one every minutes/24), decodes test_2016_flickr with beam 4,
and its detokenized output is scored here by one sacreBLEU call for all. One line per system and precision:

    system=S precision=P minutes=M updates=N tok_per_s=X bleu_cased=B bleu_lc=B

appended, with more detail, to WORK/results.jsonl; the plot (plot.py) is drawn from every run recorded there.
tok_per_s: the median of the target tokens per second each toolkit logs (megaformer's metrics.jsonl, fairseq's
``wps``, OpenNMT-py's target ``tok/s``). Minutes: training time for megaformer and for both wrappers' clocks (from
the first update, saves included).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from megaformer.cpuinfo import cpu_field, cpu_flags  # noqa: E402
from megaformer.decode.evaluate import corpus_scores  # noqa: E402
from megaformer.errors import MegaformerError  # noqa: E402
from megaformer.recipes import multi30k as m30k  # noqa: E402
from megaformer.recipes.steps import RecipeError, Step, megaformer  # noqa: E402

TEST = "test_2016_flickr"


@dataclass
class Result:
    system: str
    precision: str
    minutes: str
    updates: int
    tok_per_s: float
    bleu_cased: float
    bleu_lc: float
    extra: dict = field(default_factory=dict)

    def line(self) -> str:
        return (
            f"system={self.system} precision={self.precision} minutes={self.minutes} updates={self.updates} "
            f"tok_per_s={self.tok_per_s:.0f} bleu_cased={self.bleu_cased:.2f} bleu_lc={self.bleu_lc:.2f}"
        )


def recipe(minutes: str, precision: str, machine: m30k.Machine) -> dict:
    """megaformer's settings for this machine, minutes and precision, as the numbers a peer's options take."""
    from megaformer.config import load_config

    choices = m30k.choose(minutes, machine, precision)
    cfg = load_config(ROOT / m30k.CONFIG, [a for a in choices.overrides() if a != "--set"])
    m, t, d = cfg.model, cfg.train, cfg.decode
    peak = t.lr_scale * m.d_model**-0.5 * t.warmup_steps**-0.5  # train/schedule.py: the peak at warmup_steps
    return {
        "minutes": float(minutes), "precision": precision, "d_model": m.d_model, "d_ff": m.d_ff,
        "heads": m.num_heads, "encoder_layers": m.encoder_layers, "decoder_layers": m.decoder_layers,
        "norm": m.norm, "dropout": m.dropout, "attention_dropout": m.attention_dropout,
        "activation_dropout": m.activation_dropout, "max_positions": m.max_positions,
        "tokens_per_step": t.tokens_per_step, "lr_scale": t.lr_scale, "peak_lr": peak, "warmup_max": t.warmup_steps,
        "warmup_fraction": t.warmup_fraction, "adam_betas": [t.adam_beta1, t.adam_beta2], "adam_eps": t.adam_eps,
        "weight_decay": t.weight_decay, "clip_grad": t.clip_grad, "label_smoothing": t.label_smoothing,
        "seed": t.seed, "saves": m30k.SAVES_PER_RUN, "average": m30k.AVERAGE_LAST, "beam": d.beam,
        "lenpen": d.lenpen, "max_len_a": d.max_len_a, "max_len_b": d.max_len_b,
    }  # fmt: skip


def run_megaformer(args, precision: str, work: Path) -> Result:
    """``megaformer multi30k`` for the minutes at ``precision`` in its own work dir (never a resume)."""
    argv = ["multi30k", "--data", str(args.data), "--minutes", args.minutes, "--precision", precision]
    Step(f"megaformer {precision}", megaformer(*argv, "--tests", TEST, "--work", str(work))).run()
    tag = m30k.Multi30k(data=args.data, work=work, minutes=args.minutes).tag
    lines = [json.loads(x) for x in (work / f"run{tag}" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [x for x in lines if x.get("kind") == "train"]
    hyps = (work / f"{TEST}{tag}.hyp").read_text(encoding="utf-8").splitlines()
    updates = max(int(x["step"]) for x in lines if "step" in x)
    rate = statistics.median(x["tokens_per_s"] for x in train) if train else 0.0
    return scored("megaformer", precision, args, hyps, updates, rate, {"work": str(work)})


def reference(data: Path) -> list[str]:
    path = m30k.data_side(data, TEST, "de")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def scored(system: str, precision: str, args, hyps: list[str], updates: int, rate: float, extra: dict) -> Result:
    refs = reference(args.data)
    if len(hyps) != len(refs):
        raise RecipeError(f"{system}: {len(hyps)} translations for {len(refs)} references of {TEST}")
    s = corpus_scores(hyps, refs)
    return Result(system, precision, args.minutes, updates, rate, s.bleu, s.bleu_lc, extra)


def machine_line() -> dict:
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx")))
    return {"cpu": cpu_field("model name") or platform.processor(), "cores": os.cpu_count(), "flags": flags}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", required=True, help="training minutes of every system")
    p.add_argument("--systems", default="fairseq opennmt megaformer", help="space-separated (default: all)")
    p.add_argument("--precisions", default="fp32 bf16", help="megaformer's (bf16 only where the CPU has it)")
    p.add_argument("--data", type=Path, default=ROOT.parent / "shared/data/multi30k")
    p.add_argument("--work", type=Path, default=ROOT / "runs/peers")
    p.add_argument("--peers", type=Path, default=Path(os.environ.get("PEERS_HOME", ROOT / ".peers")))
    p.add_argument("--plot", type=Path, default=ROOT / "docs/peers.png")
    args = p.parse_args(argv)
    args.minutes = m30k.check_minutes(args.minutes)
    args.data = args.data.resolve()
    args.work = args.work.resolve()
    unknown = set(args.systems.split()) - {"fairseq", "opennmt", "megaformer"}
    if unknown:
        p.error(f"--systems: unknown {' '.join(sorted(unknown))} (fairseq, opennmt, megaformer)")
    if set(args.precisions.split()) - {"fp32", "bf16"} or not args.precisions.split():
        p.error(f"--precisions {args.precisions!r}: fp32, bf16 or both")
    for system in set(args.systems.split()) - {"megaformer"}:
        if not (args.peers / system / ".installed").is_file():
            p.error(f"{args.peers / system}: {system} is not installed there: run bash benchmarks/peers/install.sh")
    return args


def main(argv: list[str] | None = None) -> int:
    import peer_fairseq
    import peer_opennmt
    import plot
    import text

    args = parse_args(argv)
    machine = m30k.Machine.detect()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs = args.work / f"{stamp}-{args.minutes}m"
    shared = text.prepare(args.data, args.work, TEST)
    fp32 = recipe(args.minutes, "fp32", machine)
    results: list[Result] = []
    for system in args.systems.split():
        if system == "megaformer":
            for precision in args.precisions.split():
                if precision == "bf16" and not machine.native_bf16:
                    print("compare.py: megaformer bf16 skipped: this CPU has no native bf16 (avx512_bf16/amx)")
                    continue
                results.append(run_megaformer(args, precision, runs / f"megaformer-{precision}"))
                print(results[-1].line(), flush=True)
        else:
            peer = {"fairseq": peer_fairseq, "opennmt": peer_opennmt}[system]
            venv = args.peers / system
            hyps, updates, rate, extra = peer.run(fp32, shared, runs / system, venv)
            results.append(scored(system, "fp32", args, hyps, updates, rate, extra))
            print(results[-1].line(), flush=True)
    record = {"when": stamp, "machine": machine_line(), "recipe_fp32": fp32, "data": str(args.data)}
    with open(args.work / "results.jsonl", "a", encoding="utf-8") as f:
        for r in results:
            f.write(json.dumps({**record, **asdict(r)}) + "\n")
    print("\n".join(r.line() for r in results))
    plot.draw(args.work / "results.jsonl", args.plot, args.peers)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except MegaformerError as err:  # a step that failed, missing data: one line, the step's output is above it
        sys.exit(f"compare.py: {err}")
