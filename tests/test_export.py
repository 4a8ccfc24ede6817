"""megaformer export: parity of the Hugging Face Marian and CTranslate2 exports against those tools' own code.

A tiny model is trained here to reverse sentences (sentencepiece trained on the fly, a
few hundred Adam steps: see ``decode_helpers``). The references are independent of
megaformer: ``MarianMTModel``'s forward and ``generate``, ``MarianTokenizer``, and
CTranslate2's ``Translator``. Beam parity uses length penalty 0 in every engine (plain
log-probability), the one setting the three search implementations share; differences
are printed with both outputs.
"""

from __future__ import annotations

import io
import json
import random
import sys

import pytest
import torch
from decode_helpers import make_text_checkpoint, one_thread, random_sentence, reverse_sentence  # noqa: F401

from megaformer import cli
from megaformer.checkpoint import CheckpointState, load_consolidated, reshard, save_checkpoint
from megaformer.config import to_dict
from megaformer.decode.beam import SearchSettings
from megaformer.decode.loading import build_model, load_model_file, load_tokenizer
from megaformer.decode.translate import translate_ids
from megaformer.parallel import LOCAL

transformers = pytest.importorskip("transformers")
ctranslate2 = pytest.importorskip("ctranslate2")

SENTENCES = 100
MAX_NEW = 40  # output tokens before a forced eos; the reversals here need at most ~20


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A trained consolidated model, a TP=1 run directory holding it, and 100 test pairs."""
    folder = tmp_path_factory.mktemp("export")
    model_path = make_text_checkpoint(folder, steps=300)["final"]
    model = load_consolidated(model_path)
    from megaformer.parallel import ParallelContext

    spm_path = folder / "spm.model"
    meta = {"config": to_dict(model.config), "vocab_size": model.vocab_size, "tokens": 0}
    state = {"param": model.model, **{k: {n: t * 0 for n, t in model.model.items()} for k in ("exp_avg", "exp_avg_sq")}}
    state = CheckpointState(shard=state, run={"engine": {}, "trainer": {"tokens": 0}}, replica={}, rank={})
    step = save_checkpoint(folder / "run" / "checkpoints", 300, ParallelContext.single(), state, meta, 2, spm_path)
    rng = random.Random(77)
    lines = [random_sentence(rng, 2, 8) for _ in range(SENTENCES)]
    return {"dir": folder, "pt": model_path, "model": model, "step": step, "lines": lines}


@pytest.fixture(scope="module")
def exports(trained):
    """Every export of the trained model, written through the command as a user runs it."""
    out = {}
    for name, fmt in (("hf", "hf"), ("ct2", "ct2"), ("model.safetensors", None), ("sdir", "safetensors")):
        path = trained["dir"] / "exports" / name
        argv = ["export", "--ckpt", trained["dir"] / "run", "--out", path] + (["--format", fmt] if fmt else [])
        assert cli.main([str(a) for a in argv]) == 0
        out[name] = path
    return out


@pytest.fixture(scope="module")
def hf(exports):
    model, info = transformers.MarianMTModel.from_pretrained(str(exports["hf"]), output_loading_info=True)
    tokenizer = transformers.MarianTokenizer.from_pretrained(str(exports["hf"]))
    return model.eval(), tokenizer, info


def _megaformer_tokens(trained, beam: int) -> list[list[int]]:
    model = trained["model"]
    sp = load_tokenizer(model)
    net = build_model(model, LOCAL)
    settings = SearchSettings(beam=beam, lenpen=0.0, max_len_a=0.0, max_len_b=MAX_NEW)
    return [h.tokens for h in translate_ids(net, [sp.encode(x) + [3] for x in trained["lines"]], settings, 4096)]


def _megaformer_outputs(trained, beam: int) -> list[str]:
    sp = load_tokenizer(trained["model"])
    return [sp.decode(tokens) for tokens in _megaformer_tokens(trained, beam)]


def _differences(ours: list[str], theirs: list[str], lines: list[str]) -> list[str]:
    return [f"{src!r}: megaformer {a!r}, other {b!r}" for src, a, b in zip(lines, ours, theirs) if a != b]


def test_hf_directory_loads_without_missing_or_unexpected_weights(hf):
    _, _, info = hf
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


def test_marian_tokenizer_encodes_as_megaformer(trained, hf):
    _, tokenizer, _ = hf
    sp = load_tokenizer(trained["model"])
    for line in trained["lines"]:
        assert tokenizer(line).input_ids == sp.encode(line) + [3], line


def test_marian_logits_equal_megaformer_logits(trained, hf):
    """Teacher-forced logits of 100 pairs in one padded batch: MarianMTModel's forward vs megaformer's."""
    marian, tokenizer, _ = hf
    sp = load_tokenizer(trained["model"])
    net = build_model(trained["model"], LOCAL)
    batch = tokenizer(trained["lines"], return_tensors="pt", padding=True)
    targets = [[2] + sp.encode(reverse_sentence(x)) for x in trained["lines"]]
    length = max(len(t) for t in targets)
    tgt = torch.tensor([t + [0] * (length - len(t)) for t in targets])
    with torch.no_grad():
        ours = net(batch.input_ids, tgt)[..., : trained["model"].vocab_size]
        theirs = marian(input_ids=batch.input_ids, attention_mask=batch.attention_mask, decoder_input_ids=tgt).logits
    real = tgt.ne(0)
    real[:, 0] = True
    diff = (ours - theirs).abs()[real].max().item()
    assert diff <= 1e-4, diff
    assert ours[real].abs().max() > 1.0  # logits of a trained model, not zeros


def _hf_generate(hf, lines: list[str], beam: int) -> list[str]:
    marian, tokenizer, _ = hf
    batch = tokenizer(lines, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = marian.generate(**batch, num_beams=beam, do_sample=False, length_penalty=0.0, max_new_tokens=MAX_NEW + 1)
    return tokenizer.batch_decode(out, skip_special_tokens=True)


def _hf_generate_ids(hf, lines: list[str], beam: int) -> list[list[int]]:
    """transformers' output tokens: without the decoder's start token, the eos and what pads the batch after it."""
    marian, tokenizer, _ = hf
    batch = tokenizer(lines, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = marian.generate(**batch, num_beams=beam, do_sample=False, length_penalty=0.0, max_new_tokens=MAX_NEW + 1)
    start, eos = marian.config.decoder_start_token_id, marian.config.eos_token_id
    rows = [row[1:] if row and row[0] == start else row for row in out.tolist()]
    return [row[: row.index(eos)] if eos in row else row for row in rows]


def test_greedy_outputs_identical(trained, hf):
    """The same output tokens as transformers' greedy search, sentence for sentence.

    Compared as token ids, not strings: an output the length limit stopped can end in the
    piece "▁", which sentencepiece decodes as a trailing space and MarianTokenizer drops.
    """
    ours, theirs = _megaformer_tokens(trained, 1), _hf_generate_ids(hf, trained["lines"], 1)
    diff = [f"{x!r}: megaformer {a}, transformers {b}" for x, a, b in zip(trained["lines"], ours, theirs) if a != b]
    assert not diff
    sp = load_tokenizer(trained["model"])
    assert (
        sum(sp.decode(a) == reverse_sentence(x) for a, x in zip(ours, trained["lines"])) > SENTENCES // 5
    )  # a partly trained model, not noise


def test_beam4_identical_on_99_percent(trained, hf):
    ours, theirs = _megaformer_outputs(trained, 4), _hf_generate(hf, trained["lines"], 4)
    diff = _differences(ours, theirs, trained["lines"])
    print("\n".join(["beam 4, megaformer vs transformers:"] + diff or ["no differences"]))
    assert len(diff) <= SENTENCES // 100, diff


def _ct2_objective(trained, source: str, output: list[int]) -> float:
    """What CTranslate2's search maximises here, computed with megaformer's own model in float64.

    log P(output + eos | source) with the softmax renormalised without the suppressed pad
    and bos, and no eos scored for an output the length limit stopped (MAX_NEW tokens):
    CTranslate2 ends such a hypothesis as it is, where megaformer forces and scores an eos.
    """
    sp = load_tokenizer(trained["model"])
    net = build_model(trained["model"], LOCAL)
    y = output + [3]
    with torch.no_grad():
        logits = net(torch.tensor([sp.encode(source) + [3]]), torch.tensor([[2] + output]))[0]
    z = logits[:, : trained["model"].vocab_size].double()
    z[:, [0, 2]] = float("-inf")  # suppress_sequences=[["<pad>"], ["<s>"]]
    logp = z.log_softmax(-1)
    scored = y if len(output) < MAX_NEW else output
    return float(sum(logp[i, t] for i, t in enumerate(scored)))


def _ct2_translate(trained, exports, beam: int):
    sp = load_tokenizer(trained["model"])
    translator = ctranslate2.Translator(str(exports["ct2"]), device="cpu", intra_threads=1)
    return translator.translate_batch(
        [sp.encode(x, out_type=str) + ["</s>"] for x in trained["lines"]],
        beam_size=beam,
        length_penalty=0.0,
        max_decoding_length=MAX_NEW,  # output tokens without the eos
        suppress_sequences=[["<pad>"], ["<s>"]],
        min_decoding_length=0,  # CTranslate2's default 1 would forbid an immediate eos
        return_scores=True,
    )


def test_ctranslate2_greedy_strings_identical(trained, exports):
    sp = load_tokenizer(trained["model"])
    theirs = [sp.decode_pieces(r.hypotheses[0]) for r in _ct2_translate(trained, exports, 1)]
    assert not _differences(_megaformer_outputs(trained, 1), theirs, trained["lines"])


def test_ctranslate2_beam4_scores_megaformers_model_and_matches_the_same_search(trained, exports, hf):
    """Every score CTranslate2's beam search reports is megaformer's model scoring that output
    under CTranslate2's objective (the same model, per sentence, to 1e-4).

    CTranslate2's search stops only when no live hypothesis can beat the best finished one
    (transformers' ``early_stopping="never"``): under that rule transformers finds the same
    outputs. megaformer's search stops when ``beam`` hypotheses have finished (fairseq,
    transformers' ``early_stopping=True``), normalises over pad and bos as training does, and
    scores the eos it forces at the length limit, so it may find other outputs: which of two
    a beam search finds is not a property of the model, and those are printed with both scores.
    """
    sp = load_tokenizer(trained["model"])
    results = _ct2_translate(trained, exports, 4)
    theirs = [sp.decode_pieces(r.hypotheses[0]) for r in results]
    marian, tokenizer, _ = hf
    batch = tokenizer(trained["lines"], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = marian.generate(
            **batch,
            num_beams=4,
            length_penalty=0.0,
            early_stopping="never",
            max_length=None,
            max_new_tokens=MAX_NEW + 1,
        )
    same_rule = _differences(tokenizer.batch_decode(out, skip_special_tokens=True), theirs, trained["lines"])
    assert len(same_rule) <= SENTENCES // 100, same_rule
    ours = _megaformer_tokens(trained, 4)
    diff = _differences([sp.decode(t) for t in ours], theirs, trained["lines"])
    print(f"\nbeam 4, megaformer vs CTranslate2: {SENTENCES - len(diff)}/{SENTENCES} identical")
    for src, a, r in zip(trained["lines"], ours, results):
        b = [sp.piece_to_id(piece) for piece in r.hypotheses[0]]
        lb = _ct2_objective(trained, src, b)
        assert abs(lb - r.scores[0]) <= 1e-4 * max(1.0, abs(lb)), (src, lb, r.scores[0])
        if sp.decode(a) != sp.decode(b):
            la = _ct2_objective(trained, src, a)
            print(f"  {src!r}: megaformer {sp.decode(a)!r} ({la:.4f}), CTranslate2 {sp.decode(b)!r} ({lb:.4f})")


def test_export_of_tp2_checkpoint_equals_export_resharded_to_tp1(trained, tmp_path):
    tp2 = reshard(trained["step"], tmp_path / "tp2", 2, log=print)
    tp1 = reshard(tp2, tmp_path / "tp1", 1, log=print)
    assert json.loads((tp2 / "meta.json").read_text())["layout"]["tp"] == 2
    for fmt in ("hf", "safetensors"):
        a, b = tmp_path / f"{fmt}-from-tp2", tmp_path / f"{fmt}-from-tp1"
        assert cli.main(["export", "--ckpt", str(tp2), "--out", str(a), "--format", fmt]) == 0
        assert cli.main(["export", "--ckpt", str(tp1), "--out", str(b), "--format", fmt]) == 0
        ta, tb = _safetensors(a / "model.safetensors"), _safetensors(b / "model.safetensors")
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), fmt
        files_a = json.loads((a / "megaformer-export.json").read_text())["files"]
        files_b = json.loads((b / "megaformer-export.json").read_text())["files"]
        assert files_a["model.safetensors"] == files_b["model.safetensors"] or fmt == "safetensors"


def _safetensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _translate(ckpt, lines: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(("\n".join(lines) + "\n").encode())))
    code = cli.main(["translate", "--ckpt", str(ckpt), "--beam", "2", "--quiet"])
    out, err = capsys.readouterr()
    return code, out, err


def test_translate_accepts_every_export_and_checkpoint_form(trained, exports, monkeypatch, capsys):
    lines = trained["lines"][:12]
    expected = None
    for ckpt in (
        trained["pt"],
        trained["step"],
        trained["dir"] / "run",
        *(exports[k] for k in ("hf", "model.safetensors", "sdir")),
    ):
        code, out, err = _translate(ckpt, lines, monkeypatch, capsys)
        assert code == 0, (ckpt, err)
        expected = expected or out
        assert out == expected, ckpt
    for name in ("hf", "model.safetensors", "sdir"):
        back = load_model_file(exports[name])
        assert all(torch.equal(back.model[k], trained["model"].model[k]) for k in back.model), name
    code, _, err = _translate(exports["ct2"], lines, monkeypatch, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "ctranslate2" in err, err


def _one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err


def _flip_one_byte(path, offset_from_end: int = 16) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x55
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("target", ["model.safetensors", "sdir/model.safetensors", "hf/model.safetensors"])
def test_same_size_corruption_is_refused_by_name(trained, exports, tmp_path, monkeypatch, capsys, target):
    import shutil

    name, _, inner = target.partition("/")
    copy = tmp_path / name
    (shutil.copytree if exports[name].is_dir() else shutil.copyfile)(exports[name], copy)
    damaged = copy / inner if inner else copy
    _flip_one_byte(damaged)
    code, _, err = _translate(copy, ["red cat"], monkeypatch, capsys)
    _one_line_error(code, err, str(damaged), "sha256")


def test_existing_output_needs_force_and_the_input_is_never_replaced(trained, tmp_path, capsys):
    out = tmp_path / "m.safetensors"
    assert cli.main(["export", "--ckpt", str(trained["pt"]), "--out", str(out)]) == 0
    before = out.read_bytes()
    _one_line_error(
        cli.main(["export", "--ckpt", str(trained["pt"]), "--out", str(out)]), capsys.readouterr().err, "--force"
    )
    assert out.read_bytes() == before
    assert cli.main(["export", "--ckpt", str(trained["pt"]), "--out", str(out), "--force"]) == 0
    run = trained["dir"] / "run"
    code = cli.main(["export", "--ckpt", str(trained["step"]), "--out", str(run), "--format", "hf", "--force"])
    _one_line_error(code, capsys.readouterr().err, "input")
    assert (trained["step"] / "meta.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


@pytest.mark.parametrize(
    ("setting", "fragment", "formats"),
    [({"norm": "pre"}, "post-LN", ("hf",)), ({"layernorm_eps": 1e-6}, "1e-5", ("hf", "ct2"))],
)
def test_what_marian_cannot_express_is_refused(trained, tmp_path, capsys, setting, fragment, formats):
    import dataclasses

    from megaformer.checkpoint import save_consolidated

    model = load_consolidated(trained["pt"])
    model.config.model = dataclasses.replace(model.config.model, **setting)
    if setting.get("norm") == "pre":
        d = model.config.model.d_model
        model.model.update({f"{s}_norm.{p}": torch.ones(d) for s in ("encoder", "decoder") for p in ("weight", "bias")})
    path = tmp_path / "odd.pt"
    save_consolidated(path, model)
    for fmt in formats:
        out = tmp_path / fmt
        _one_line_error(
            cli.main(["export", "--ckpt", str(path), "--out", str(out), "--format", fmt]),
            capsys.readouterr().err,
            fragment,
        )
        assert not out.exists()
    assert cli.main(["export", "--ckpt", str(path), "--out", str(tmp_path / "ok.safetensors")]) == 0


@pytest.fixture(scope="module")
def pre_ln(tmp_path_factory):
    """A trained pre-LN model and its CTranslate2 export, written through the command.

    The final LayerNorm of each stack is scaled and shifted off what training left (a model all
    the same), so that an export that dropped it or kept another would not score as this one.
    """
    from megaformer.checkpoint import save_consolidated
    from megaformer.export.marian import FINAL_NORMS

    folder = tmp_path_factory.mktemp("export-pre")
    path = make_text_checkpoint(folder, steps=300, norm="pre")["final"]
    model = load_consolidated(path)
    g = torch.Generator().manual_seed(3)
    for name in FINAL_NORMS:
        t = model.model[name]
        noise = torch.randn(t.shape, generator=g)
        model.model[name] = t * (1 + 0.3 * noise) if name.endswith("weight") else t + 0.2 * noise
    save_consolidated(path, model)
    out = folder / "ct2"
    assert cli.main(["export", "--ckpt", str(path), "--out", str(out), "--format", "ct2"]) == 0
    rng = random.Random(78)
    return {"model": model, "lines": [random_sentence(rng, 2, 8) for _ in range(SENTENCES)], "ct2": out}


def test_ctranslate2_takes_a_pre_ln_model_exactly(pre_ln):
    """Pre-LN layers and the final LayerNorms, which Marian cannot hold, reach CTranslate2: greedy outputs
    are identical, and every beam-4 score is megaformer's model scoring that output (as above, to 1e-4)."""
    sp = load_tokenizer(pre_ln["model"])
    greedy = [sp.decode_pieces(r.hypotheses[0]) for r in _ct2_translate(pre_ln, pre_ln, 1)]
    assert not _differences(_megaformer_outputs(pre_ln, 1), greedy, pre_ln["lines"])
    for src, r in zip(pre_ln["lines"], _ct2_translate(pre_ln, pre_ln, 4)):
        b = [sp.piece_to_id(piece) for piece in r.hypotheses[0]]
        lb = _ct2_objective(pre_ln, src, b)
        assert abs(lb - r.scores[0]) <= 1e-4 * max(1.0, abs(lb)), (src, lb, r.scores[0])
