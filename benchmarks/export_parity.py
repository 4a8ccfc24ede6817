"""Parity of ``megaformer export --format hf|ct2`` with transformers and CTranslate2 on real-sized models.

    python benchmarks/export_parity.py [--ckpt RUN_OR_MODEL --src FILE --ref FILE] [--d-model 256 ...] [--json]

Without ``--ckpt`` the model is Multi30k-sized (configs/multi30k.yaml's shape by default),
its sentencepiece model (8000 pieces) trained on Multi30k's English and German training
text read from ``--data`` (../shared/data/multi30k; nothing is copied into the tree), and
its random weights briefly trained (``--train-steps``, 300 Adam steps in a minute or two):
a model with random weights never ends a sentence, so every search would only meet its
length limit, where the engines' rules differ, rather than the decisions that matter. With ``--ckpt`` (for instance the demo's run directory) the trained
model and its own tokenizer are used, with the sentences of ``--src`` / ``--ref``.

On the first ``--sentences`` pairs it reports: the largest |logit difference| between
megaformer's forward and ``MarianMTModel``'s (teacher-forced on the references, fp32), and
the largest |log-probability difference| between megaformer's and CTranslate2's
``score_batch`` (teacher-forced); how many greedy outputs are identical strings (megaformer
vs ``generate``, megaformer vs CTranslate2); beam 4 with length penalty 0 (the setting the
engines share) megaformer vs transformers (``early_stopping=True``, megaformer's fairseq
rule), CTranslate2 vs transformers (``early_stopping="never"``, CTranslate2's rule) and
megaformer vs CTranslate2, each difference listed with megaformer's log P of both outputs.
A pre-LN model (``--norm pre``, or a checkpoint of one) has no Marian export: only the
CTranslate2 figures are reported. With ``--reshard-check`` and a TP>1 checkpoint it also
exports the checkpoint resharded to TP=1 and compares the weights (of the hf export; of the
safetensors export for a pre-LN model).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see benchmarks/decode.py

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model_args import add_model_arguments, model_config, random_model  # noqa: E402

from megaformer.checkpoint import Consolidated  # noqa: E402
from megaformer.cli import Parser  # noqa: E402
from megaformer.cli_args import nonneg_int, positive_int  # noqa: E402
from megaformer.config import Config  # noqa: E402
from megaformer.decode.beam import SearchSettings  # noqa: E402
from megaformer.decode.loading import build_model, load_model_file, load_tokenizer  # noqa: E402
from megaformer.decode.translate import translate_ids  # noqa: E402
from megaformer.export.write import write_export  # noqa: E402
from megaformer.model import Transformer  # noqa: E402
from megaformer.parallel import LOCAL, gather_full_state  # noqa: E402

EOS = 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog="export_parity", description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", help="a trained run directory, step directory or model file (default: random weights)")
    p.add_argument("--src", help="source sentences for --ckpt")
    p.add_argument("--ref", help="reference translations for --ckpt (teacher forcing)")
    p.add_argument("--data", default="../shared/data/multi30k", help="Multi30k folder (as make multi30k)")
    add_model_arguments(p, layers=3)
    p.add_argument("--train-steps", type=nonneg_int, default=300, help="brief training of the random model (0: none)")
    p.add_argument("--sentences", type=positive_int, default=100)
    p.add_argument("--max-new", type=positive_int, default=40, help="output tokens before a forced eos")
    p.add_argument("--reshard-check", action="store_true")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def read_text(path: Path) -> list[str]:
    """Lines of a text file, gzip-compressed or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def multi30k_model(args: argparse.Namespace, tmp: Path) -> Consolidated:
    """A random-weight model of the requested shape with a sentencepiece model trained on Multi30k."""
    from megaformer.data.tokenizer import train_bpe

    data = Path(args.data)
    text = tmp / "train.txt"
    text.write_text("\n".join(read_text(data / "train.en.gz") + read_text(data / "train.de.gz")) + "\n")
    train_bpe([text], tmp / "spm.model", args.vocab, seed=1)
    cfg = Config()
    cfg.model = model_config(args, 256)
    net = random_model(cfg.model, args.vocab)
    if args.train_steps:
        pairs = list(zip(read_text(data / "train.en.gz"), read_text(data / "train.de.gz")))
        brief_training(net, pairs, tmp / "spm.model", args.train_steps)
    return Consolidated(
        cfg, gather_full_state(net, LOCAL), args.vocab, (tmp / "spm.model").read_bytes(), {"step": args.train_steps}
    )


def brief_training(net: Transformer, pairs: list[tuple[str, str]], spm_path: Path, steps: int) -> None:
    """``steps`` Adam steps (peak lr 5e-4, 48 random pairs each): enough for outputs that end with eos, not for BLEU."""
    import random

    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(spm_path))
    rng = random.Random(1)
    opt = torch.optim.Adam(net.parameters(), lr=5e-4, betas=(0.9, 0.98))
    # Linear warm-up over the first third: a deep post-LN model trained at full rate from step 1 collapses
    # to predicting eos at once (measured at 6 + 6 layers).
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / max(1, steps // 3)))
    net.train()
    for _ in range(steps):
        batch = [(sp.encode(s)[:60], sp.encode(t)[:60]) for s, t in rng.sample(pairs, 48)]
        s_len, t_len = max(len(s) for s, _ in batch) + 1, max(len(t) for _, t in batch) + 1
        src = torch.zeros(len(batch), s_len, dtype=torch.long)
        tgt_in, tgt_out = (
            torch.zeros(len(batch), t_len, dtype=torch.long),
            torch.zeros(len(batch), t_len, dtype=torch.long),
        )
        for i, (s, t) in enumerate(batch):
            src[i, : len(s) + 1] = torch.tensor(s + [EOS])
            tgt_in[i, : len(t) + 1] = torch.tensor([2] + t)
            tgt_out[i, : len(t) + 1] = torch.tensor(t + [EOS])
        loss, n = net.loss(src, tgt_in, tgt_out, label_smoothing=0.1)
        opt.zero_grad()
        (loss / n).backward()
        opt.step()
        schedule.step()
    net.eval()


def megaformer_outputs(model: Consolidated, lines: list[str], beam: int, max_new: int) -> tuple[list[str], float]:
    """Detokenized outputs of megaformer's search (length penalty 0) and the seconds it took."""
    sp = load_tokenizer(model)
    net = build_model(model, LOCAL)
    settings = SearchSettings(beam=beam, lenpen=0.0, max_len_a=0.0, max_len_b=max_new)
    start = time.perf_counter()
    hyps = translate_ids(net, [sp.encode(x) + [EOS] for x in lines], settings, 4096)
    return [sp.decode(h.tokens) for h in hyps], time.perf_counter() - start


def hf_outputs(hf, lines: list[str], beam: int, max_new: int, stopping, batch: int = 50) -> tuple[list[str], float]:
    """Outputs of ``MarianMTModel.generate`` (length penalty 0) in batches of ``batch``, and the seconds."""
    model, tokenizer = hf
    search = {"num_beams": beam, "length_penalty": 0.0, "early_stopping": stopping} if beam > 1 else {"num_beams": 1}
    out, start = [], time.perf_counter()
    for i in range(0, len(lines), batch):
        enc = tokenizer(lines[i : i + batch], return_tensors="pt", padding=True)
        with torch.no_grad():
            ids = model.generate(**enc, **search, do_sample=False, max_length=None, max_new_tokens=max_new + 1)
        out += tokenizer.batch_decode(ids, skip_special_tokens=True)
    return out, time.perf_counter() - start


def ct2_outputs(translator, sp, lines: list[str], beam: int, max_new: int) -> tuple[list[str], float]:
    """Outputs of CTranslate2's ``translate_batch`` (length penalty 0, pad and bos suppressed), and the seconds."""
    from megaformer.export.ct2 import SUPPRESS

    start = time.perf_counter()
    results = translator.translate_batch(
        [sp.encode(x, out_type=str) + ["</s>"] for x in lines],
        beam_size=beam,
        length_penalty=0.0,
        max_decoding_length=max_new,  # CTranslate2 counts output tokens without the eos
        suppress_sequences=SUPPRESS,
        min_decoding_length=0,  # CTranslate2's default 1 would forbid an immediate eos
        max_batch_size=64,
    )
    return [sp.decode_pieces(r.hypotheses[0]) for r in results], time.perf_counter() - start


def max_logit_difference(model: Consolidated, hf, src: list[str], ref: list[str]) -> float:
    """max |megaformer logits - MarianMTModel logits| over every real target position, teacher-forced."""
    marian, tokenizer = hf
    sp = load_tokenizer(model)
    net = build_model(model, LOCAL)
    worst = 0.0
    for i in range(0, len(src), 25):
        enc = tokenizer(src[i : i + 25], return_tensors="pt", padding=True)
        targets = [[2] + sp.encode(x)[:200] for x in ref[i : i + 25]]
        length = max(len(t) for t in targets)
        tgt = torch.tensor([t + [0] * (length - len(t)) for t in targets])
        with torch.no_grad():
            ours = net(enc.input_ids, tgt)[..., : model.vocab_size]
            theirs = marian(input_ids=enc.input_ids, attention_mask=enc.attention_mask, decoder_input_ids=tgt).logits
        real = torch.ones_like(tgt, dtype=torch.bool)
        for row, t in enumerate(targets):
            real[row, len(t) :] = False
        worst = max(worst, float((ours - theirs).abs()[real].max()))
    return worst


def ct2_max_logprob_difference(model: Consolidated, translator, src: list[str], ref: list[str]) -> float:
    """max |megaformer log P - CTranslate2 log P| of every reference token and eos, teacher-forced (``score_batch``)."""
    sp = load_tokenizer(model)
    net = build_model(model, LOCAL)
    worst = 0.0
    for s, r in zip(src, ref):
        y = sp.encode(r)[:200] + [EOS]
        scored = translator.score_batch([sp.encode(s, out_type=str) + ["</s>"]], [[sp.id_to_piece(t) for t in y[:-1]]])
        with torch.no_grad():
            logits = net(torch.tensor([sp.encode(s) + [EOS]]), torch.tensor([[2] + y[:-1]]))[0]
        ours = logits[:, : model.vocab_size].double().log_softmax(-1).gather(1, torch.tensor(y)[:, None])[:, 0]
        worst = max(worst, float((ours - torch.tensor(scored[0].log_probs, dtype=torch.float64)).abs().max()))
    return worst


def log_prob(model: Consolidated, source: str, output: str) -> float:
    """log P(output + eos | source) under megaformer's model (float64 softmax)."""
    sp = load_tokenizer(model)
    net = build_model(model, LOCAL)
    y = sp.encode(output) + [EOS]
    with torch.no_grad():
        logits = net(torch.tensor([sp.encode(source) + [EOS]]), torch.tensor([[2] + y[:-1]]))[0]
    logp = logits[:, : model.vocab_size].double().log_softmax(-1)
    return float(sum(logp[i, t] for i, t in enumerate(y)))


def compare(name: str, a: list[str], b: list[str], src: list[str], model: Consolidated | None = None) -> dict:
    """How many of ``a`` and ``b`` are identical, and the differences (with log P of both when ``model``)."""
    diffs = []
    for s, x, y in zip(src, a, b):
        if x != y:
            d = {"source": s, "first": x, "second": y}
            if model is not None:
                d["logp_first"], d["logp_second"] = round(log_prob(model, s, x), 4), round(log_prob(model, s, y), 4)
            diffs.append(d)
    return {"name": name, "identical": len(a) - len(diffs), "of": len(a), "differences": diffs}


def reshard_check(ckpt: str, tmp: Path) -> dict:
    """Export of a TP>1 step directory vs export of the same checkpoint resharded to TP=1: bitwise weights."""
    from safetensors.torch import load_file

    from megaformer.checkpoint import check_complete, reshard, resolve_checkpoint

    step = resolve_checkpoint(Path(ckpt), log=lambda m: None)
    tp = check_complete(step)["layout"]["tp"]
    tp1 = reshard(step, tmp / "tp1", 1, log=print)
    out = {}
    for label, src in (("original", step), ("tp1", tp1)):
        model = load_model_file(src)
        fmt = "hf" if model.config.model.norm == "post" else "safetensors"  # Marian holds post-LN models only
        write_export(model, tmp / f"{fmt}-{label}", fmt)
        out[label] = load_file(str(tmp / f"{fmt}-{label}" / "model.safetensors"))
    same = out["original"].keys() == out["tp1"].keys() and all(
        torch.equal(out["original"][k], out["tp1"][k]) for k in out["original"]
    )
    return {"checkpoint_tp": tp, "bitwise_equal": same, "tensors": len(out["original"])}


def run(args: argparse.Namespace, tmp: Path) -> dict:
    import ctranslate2
    from transformers import MarianMTModel, MarianTokenizer

    if args.ckpt:
        model = load_model_file(args.ckpt)
        src, ref = read_text(Path(args.src)), read_text(Path(args.ref))
    else:
        model = multi30k_model(args, tmp)
        data = Path(args.data)
        src, ref = read_text(data / "test_2016_flickr.en.gz"), read_text(data / "test_2016_flickr.de.gz")
    src, ref = src[: args.sentences], ref[: args.sentences]
    write_export(model, tmp / "ct2", "ct2")
    translator = ctranslate2.Translator(str(tmp / "ct2"), device="cpu")
    sp = load_tokenizer(model)
    m = model.config.model
    result = {
        "model": {
            "d_model": m.d_model,
            "d_ff": m.d_ff,
            "heads": m.num_heads,
            "layers": m.encoder_layers,
            "norm": m.norm,
        },
        "parameters": sum(t.numel() for t in model.model.values()),
        "source": args.ckpt or f"Multi30k tokenizer, {args.train_steps} training steps",
        "max_logprob_difference_ct2": ct2_max_logprob_difference(model, translator, src, ref),
    }
    greedy_ours, beam_ours = (megaformer_outputs(model, src, beam, args.max_new)[0] for beam in (1, 4))
    beam_ct2 = ct2_outputs(translator, sp, src, 4, args.max_new)[0]
    result["comparisons"] = [
        compare(
            "greedy megaformer vs ctranslate2", greedy_ours, ct2_outputs(translator, sp, src, 1, args.max_new)[0], src
        ),
        compare("beam4 megaformer vs ctranslate2", beam_ours, beam_ct2, src, model),
    ]
    if m.norm == "post":  # Marian, and so transformers, holds post-LN models only
        write_export(model, tmp / "hf", "hf")
        hf = (MarianMTModel.from_pretrained(str(tmp / "hf")).eval(), MarianTokenizer.from_pretrained(str(tmp / "hf")))
        result["max_logit_difference"] = max_logit_difference(model, hf, src, ref)
        beam_hf_never = hf_outputs(hf, src, 4, args.max_new, "never")[0]
        result["comparisons"] += [
            compare(
                "greedy megaformer vs transformers",
                greedy_ours,
                hf_outputs(hf, src, 1, args.max_new, True)[0],
                src,
                model,
            ),
            compare(
                "beam4 megaformer vs transformers(early_stopping=True)",
                beam_ours,
                hf_outputs(hf, src, 4, args.max_new, True)[0],
                src,
                model,
            ),
            compare("beam4 ctranslate2 vs transformers(early_stopping=never)", beam_ct2, beam_hf_never, src),
        ]
    if args.reshard_check and args.ckpt:
        result["reshard"] = reshard_check(args.ckpt, tmp)
    return result


def engine_speeds(args: argparse.Namespace, sentences: int, beam: int, tmp: Path) -> dict:
    """Sentences/s of megaformer, transformers and CTranslate2 decoding the same ``sentences`` sources.

    Each engine gets one warm-up batch, this process's torch threads (CTranslate2 as many intra
    threads), beam ``beam`` with length penalty 0 and the same length limit; megaformer and
    transformers batch 64 sentences (megaformer by up to 4096 source tokens), CTranslate2 64.
    A pre-LN model has no transformers run (Marian holds post-LN models only).
    """
    import ctranslate2
    from transformers import MarianMTModel, MarianTokenizer

    model = load_model_file(args.ckpt) if args.ckpt else multi30k_model(args, tmp)
    src = read_text(Path(args.src) if args.src else Path(args.data) / "test_2016_flickr.en.gz")[:sentences]
    write_export(model, tmp / "ct2", "ct2")
    threads = torch.get_num_threads()
    translator = ctranslate2.Translator(str(tmp / "ct2"), device="cpu", intra_threads=threads)
    sp = load_tokenizer(model)
    runs = {
        "megaformer": lambda lines: megaformer_outputs(model, lines, beam, args.max_new),
        "ctranslate2": lambda lines: ct2_outputs(translator, sp, lines, beam, args.max_new),
    }
    if model.config.model.norm == "post":
        write_export(model, tmp / "hf", "hf")
        hf = (MarianMTModel.from_pretrained(str(tmp / "hf")).eval(), MarianTokenizer.from_pretrained(str(tmp / "hf")))
        runs["transformers"] = lambda lines: hf_outputs(hf, lines, beam, args.max_new, True, batch=64)
    result: dict = {"sentences": len(src), "beam": beam, "threads": threads, "max_new_tokens": args.max_new}
    outputs = {}
    for name, fn in runs.items():
        fn(src[:8])  # warm-up
        outputs[name], seconds = fn(src)
        result[name] = {"seconds": round(seconds, 2), "sentences_per_s": round(len(src) / seconds, 2)}
    for other in set(runs) - {"megaformer"}:
        same = sum(a == b for a, b in zip(outputs["megaformer"], outputs[other]))
        result[f"identical_megaformer_{other}"] = same
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="megaformer-export-parity-") as tmp:
        result = run(args, Path(tmp))
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"model {result['model']} ({result['parameters'] / 1e6:.1f}M parameters), {result['source']}")
    if "max_logit_difference" in result:
        print(f"max |logit difference| megaformer vs MarianMTModel: {result['max_logit_difference']:.2e}")
    print(f"max |log P difference| megaformer vs CTranslate2: {result['max_logprob_difference_ct2']:.2e}")
    for c in result["comparisons"]:
        print(f"{c['name']}: {c['identical']}/{c['of']} identical")
        for d in c["differences"]:
            print(f"    {json.dumps(d, ensure_ascii=False)}")
    if "reshard" in result:
        print(
            f"export of the tp={result['reshard']['checkpoint_tp']} checkpoint vs its TP=1 reshard: {result['reshard']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
