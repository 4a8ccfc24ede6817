"""fairseq (fairseq-fixed 0.12.3.1) with megaformer's recipe: binarize, train (fairseq_train.py), decode.

The mapping, option by option (``recipe`` is :func:`compare.recipe`'s):

- model: ``--arch transformer``, the widths, heads and layers, ``--share-all-embeddings`` (megaformer ties the
  source, target and output embeddings), sinusoidal positions and embeddings scaled by sqrt(d) (both fairseq's
  defaults too); pre-LN is ``--encoder-normalize-before --decoder-normalize-before``.
- steps: ``--max-tokens tokens_per_step`` in one process (fairseq counts a batch's padded tokens of its longer
  side, as megaformer counts its micro-batches'), sentences not rounded to a multiple of 8; megaformer's two
  data-parallel processes of one thread each are one process of two threads here (``OMP_NUM_THREADS`` = the
  cores): fairseq's CPU training has no other form.
- optimizer: Adam with megaformer's betas, eps and weight decay, no clipping (``--clip-norm 0``), label-smoothed
  cross-entropy; the schedule (the peak, the warm-up fitted to the minutes) and the saves are budget.py's,
  installed by fairseq_train.py; validation off (megaformer's is outside its training minutes).
- decoding: ``fairseq-interactive``, beam 4, at most ``max_len_a x source + max_len_b`` tokens. fairseq has no
  GNMT length penalty: its ``--lenpen`` divides a score by length^lenpen, which matches GNMT's
  ((5 + L) / 6)^alpha in its slope at the test set's mean length L: lenpen = alpha x L / (5 + L).
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from common import run_logged
from text import Shared, detokenize

HERE = Path(__file__).resolve().parent


def train_args(recipe: dict, binary: Path, save_dir: Path) -> list[str]:
    r = recipe
    args = [
        str(binary), "--task", "translation", "--source-lang", "en", "--target-lang", "de",
        "--arch", "transformer", "--share-all-embeddings",
        "--encoder-layers", str(r["encoder_layers"]), "--decoder-layers", str(r["decoder_layers"]),
        "--encoder-embed-dim", str(r["d_model"]), "--decoder-embed-dim", str(r["d_model"]),
        "--encoder-ffn-embed-dim", str(r["d_ff"]), "--decoder-ffn-embed-dim", str(r["d_ff"]),
        "--encoder-attention-heads", str(r["heads"]), "--decoder-attention-heads", str(r["heads"]),
        "--max-source-positions", str(r["max_positions"]), "--max-target-positions", str(r["max_positions"]),
        "--dropout", str(r["dropout"]), "--attention-dropout", str(r["attention_dropout"]),
        "--activation-dropout", str(r["activation_dropout"]),
        "--optimizer", "adam", "--adam-betas", f"({r['adam_betas'][0]}, {r['adam_betas'][1]})",
        "--adam-eps", str(r["adam_eps"]), "--weight-decay", str(r["weight_decay"]), "--clip-norm", str(r["clip_grad"]),
        "--lr", str(r["peak_lr"]), "--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(r["warmup_max"]),
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", str(r["label_smoothing"]),
        "--max-tokens", str(r["tokens_per_step"]), "--required-batch-size-multiple", "1",
        "--seed", str(r["seed"]), "--cpu", "--num-workers", "0",
        "--disable-validation", "--max-update", "1000000", "--save-dir", str(save_dir),
        "--log-format", "json", "--log-interval", "50",
    ]  # fmt: skip
    if r["norm"] == "pre":
        args += ["--encoder-normalize-before", "--decoder-normalize-before"]
    return args


def lenpen(recipe: dict, shared: Shared) -> float:
    mean = shared.test_mean_pieces
    return recipe["lenpen"] * mean / (5.0 + mean)


def run(recipe: dict, shared: Shared, work: Path, venv: Path) -> tuple[list[str], int, float, dict]:
    """Train and decode; (detokenized test translations, updates, median target tokens/s, details)."""
    work.mkdir(parents=True, exist_ok=True)
    log, binary, save_dir = work / "fairseq.log", work / "bin", work / "checkpoints"
    text, bin_ = shared.text, venv / "bin"
    print(f"peer_fairseq: binarizing, training {recipe['minutes']:g} minutes, decoding; log {log}", flush=True)
    run_logged([str(bin_ / "fairseq-preprocess"), "--source-lang", "en", "--target-lang", "de",
          "--trainpref", str(text / "train"), "--validpref", str(text / "valid"), "--destdir", str(binary),
          "--srcdict", str(text / "dict.txt"), "--joined-dictionary", "--workers", "2"],
         log, "fairseq: fairseq-preprocess")  # fmt: skip
    (work / "budget.json").write_text(json.dumps(recipe) + "\n")
    summary = work / "summary.json"
    wrapper = [str(bin_ / "python"), str(HERE / "fairseq_train.py"), str(work / "budget.json"), str(summary), "--"]
    run_logged(wrapper + train_args(recipe, binary, save_dir), log, "fairseq: training")
    done = json.loads(summary.read_text())
    for path in save_dir.glob("checkpoint_u*.pt"):  # each holds the optimizer's state: ~0.1 GB
        if path.name not in done["averaged"]:
            path.unlink()
    out = work / "test.out"
    decode = [
        str(bin_ / "fairseq-interactive"), str(binary), "--path", str(save_dir / "averaged.pt"),
        "--source-lang", "en", "--target-lang", "de", "--input", str(text / "test.en"), "--cpu",
        "--beam", str(recipe["beam"]), "--lenpen", f"{lenpen(recipe, shared):.4f}",
        "--max-len-a", str(recipe["max_len_a"]), "--max-len-b", str(recipe["max_len_b"]),
        "--buffer-size", "1024", "--batch-size", "64",
    ]  # fmt: skip
    run_logged(decode, log, "fairseq: fairseq-interactive", stdout=out)
    hyps = {}
    for line in out.read_text(encoding="utf-8").splitlines():
        if line.startswith("H-"):
            key, _, pieces = line.split("\t", 2)
            hyps[int(key[2:])] = pieces
    missing = sorted(set(range(shared.test_lines)) - set(hyps))
    if missing:
        raise SystemExit(f"peer_fairseq: {out} has no translation of test line(s) {missing[:5]}")
    ordered = [hyps[i] for i in range(shared.test_lines)]
    rates = [float(x["wps"]) for x in _train_logs(log)]
    extra = {"work": str(work), "warmup": done["warmup"], "train_seconds": done["train_seconds"],
             "lenpen_fairseq": lenpen(recipe, shared), "averaged": done["averaged"]}  # fmt: skip
    return detokenize(shared.spm, ordered), done["updates"], statistics.median(rates) if rates else 0.0, extra


def _train_logs(log: Path) -> list[dict]:
    found = []
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        m = re.search(r"(\{.*\"wps\".*\})\s*$", line)
        if m and '"num_updates"' in m.group(1):
            try:
                found.append(json.loads(m.group(1)))
            except json.JSONDecodeError:
                pass
    return found
