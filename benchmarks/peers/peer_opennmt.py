"""OpenNMT-py 3.5.1 with megaformer's recipe: train (opennmt_train.py), average, translate.

The mapping (``recipe`` is :func:`compare.recipe`'s):

- model: a Transformer encoder and decoder of the recipe's widths, heads and layers, ``share_embeddings`` and
  ``share_decoder_embeddings`` (megaformer ties all three), interleaved sinusoidal positions (the paper's, as
  megaformer's), biases on the attention and feed-forward projections (``add_qkvbias``, ``add_ffnbias``:
  OpenNMT-py's default has none),
  LayerNorm eps 1e-5. OpenNMT-py's Transformer layers are always pre-LN, so a post-LN recipe cannot be expressed
  (the fp32 recipes are pre-LN).
- dropout: residual and embedding ``dropout``, ``attention_dropout``; OpenNMT-py also drops out after the
  feed-forward network's ReLU at the residual rate, which no option changes: the wrapper sets it to the recipe's
  ``activation_dropout`` (0).
- data: ``bucket_size`` the training pairs (the default, 262,144 examples, fills a bucket with ~9 copies of
  Multi30k, sorted by length and not shuffled between them).
- steps: ``batch_type tokens``, ``batch_size tokens_per_step`` in one process of two threads (padded tokens of a
  batch's longer side, as megaformer's), no loader workers (megaformer's recipe has none either).
- optimizer and schedule: Adam with megaformer's betas (its eps through the wrapper), no clipping, label
  smoothing; lr and saves from budget.py; validation off (outside megaformer's training minutes). Initialization
  is the toolkit's own (Glorot, embeddings included: megaformer draws them from N(0, 1/d)).
- decoding: beam 4 with GNMT's length penalty (``-length_penalty wu -alpha``, megaformer's); OpenNMT-py has no
  per-sentence ``a x source + b`` limit: ``-max_length`` is the test set's longest source plus b. Its beam search
  ends a sentence when the best hypothesis ends (megaformer and fairseq wait for ``beam`` finished ones).
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from common import run_logged
from text import Shared, detokenize

HERE = Path(__file__).resolve().parent


def config(recipe: dict, shared: Shared, work: Path) -> dict:
    r, text = recipe, shared.text
    if r["norm"] != "pre":
        print("peer_opennmt: the recipe's post-LN layers cannot be expressed: OpenNMT-py's are pre-LN", flush=True)
    return {
        "data": {"corpus_1": {"path_src": str(text / "train.en"), "path_tgt": str(text / "train.de")}},
        "src_vocab": str(text / "vocab.txt"), "share_vocab": True, "src_vocab_size": 32768,
        "tgt_vocab_size": 32768, "save_model": str(work / "model"), "save_checkpoint_steps": 10**9,
        "keep_checkpoint": -1, "seed": r["seed"], "train_steps": 10**7, "valid_steps": 10**9,
        "report_every": 50, "log_file": str(work / "onmt_train.log"), "world_size": 1, "gpu_ranks": [],
        "num_workers": 0, "bucket_size": shared.train_pairs, "batch_type": "tokens",
        "batch_size": r["tokens_per_step"], "accum_count": [1],
        "normalization": "tokens", "optim": "adam", "adam_beta1": r["adam_betas"][0],
        "adam_beta2": r["adam_betas"][1], "learning_rate": 1.0, "decay_method": "noam",
        "warmup_steps": r["warmup_max"], "max_grad_norm": r["clip_grad"], "weight_decay": r["weight_decay"],
        "label_smoothing": r["label_smoothing"], "param_init": 0.0, "param_init_glorot": True,
        "encoder_type": "transformer", "decoder_type": "transformer", "enc_layers": r["encoder_layers"],
        "dec_layers": r["decoder_layers"], "hidden_size": r["d_model"], "word_vec_size": r["d_model"],
        "transformer_ff": r["d_ff"], "heads": r["heads"], "dropout": [r["dropout"]],
        "attention_dropout": [r["attention_dropout"]], "position_encoding": True,
        "position_encoding_type": "SinusoidalInterleaved", "share_embeddings": True,
        "share_decoder_embeddings": True, "add_qkvbias": True, "add_ffnbias": True, "norm_eps": 1e-5,
        "layer_norm": "standard",
        "pos_ffn_activation_fn": "relu", "max_relative_positions": 0,
    }  # fmt: skip


def prune(saved, keep: list[str]) -> None:
    """Delete the saves that were not averaged (each holds the optimizer's state: ~0.1 GB)."""
    for path in saved:
        if str(path) not in keep:
            path.unlink()


def run(recipe: dict, shared: Shared, work: Path, venv: Path) -> tuple[list[str], int, float, dict]:
    """Train and decode; (detokenized test translations, updates, median target tokens/s, details)."""
    work.mkdir(parents=True, exist_ok=True)
    log, bin_ = work / "opennmt.log", venv / "bin"
    print(f"peer_opennmt: training {recipe['minutes']:g} minutes, averaging, decoding; log {log}", flush=True)
    (work / "train.yaml").write_text(json.dumps(config(recipe, shared, work), indent=1) + "\n")  # JSON is YAML
    (work / "budget.json").write_text(json.dumps(recipe) + "\n")
    summary = work / "summary.json"
    wrapper = [str(bin_ / "python"), str(HERE / "opennmt_train.py"), str(work / "budget.json"), str(summary), "--"]
    run_logged(wrapper + ["-config", str(work / "train.yaml")], log, "opennmt: training")
    done = json.loads(summary.read_text())
    models = [str(work / f"model_step_{s}.pt") for s in done["saved"][-recipe["average"] :]]
    run_logged(
        [str(bin_ / "onmt_average_models"), "-models", *models, "-output", str(work / "averaged.pt")],
        log,
        "opennmt: average",
    )
    prune(work.glob("model_step_*.pt"), models)
    out = work / "test.out"
    run_logged([str(bin_ / "onmt_translate"), "-model", str(work / "averaged.pt"), "-src", str(shared.text / "test.en"),
          "-output", str(out), "-beam_size", str(recipe["beam"]), "-length_penalty", "wu",
          "-alpha", str(recipe["lenpen"]), "-max_length", str(shared.test_max_pieces + recipe["max_len_b"]),
          "-max_length_ratio", "0", "-batch_size", "64", "-batch_type", "sents"],
         log, "opennmt: onmt_translate")  # fmt: skip
    hyps = out.read_text(encoding="utf-8").splitlines()
    rates = [
        float(m.group(1)) for m in re.finditer(r"\d+/\s*(\d+) tok/s", log.read_text(encoding="utf-8", errors="replace"))
    ]
    extra = {"work": str(work), "warmup": done["warmup"], "train_seconds": done["train_seconds"], "averaged": models}
    return detokenize(shared.spm, hyps), done["updates"], statistics.median(rates) if rates else 0.0, extra
