"""The paper's BLEU beside sacreBLEU's: Moses-tokenized, compound-split, multi-bleu.perl's corpus BLEU.

The figures below are computed by hand (the n-gram counts in the comments) and agree with
tensor2tensor's get_ende_bleu.sh of 2017 run with Perl: Moses' tokenizer.perl -l de (its
version of December 2016), the ##AT## one-liner and multi-bleu.perl print the same lines.
``megaformer evaluate --hyp FILE --ref FILE`` scores a given output without a model; mixing
it with the options that translate is refused in one line.
"""

from __future__ import annotations

import json

import pytest
from cli_helpers import assert_one_line_error
from sacrebleu.metrics import BLEU

from megaformer.commands.evaluate import target_language
from megaformer.decode.evaluate import moses_compound_split, tokenized_bleu
from megaformer.errors import DataError

REFS = ["Das Gutach-Zentrum hat am Montag geöffnet.", "„Wir sind froh“, sagte die Ski-Lehrerin."]
HYPS = ["Das Gutach Zentrum hat am Montag geöffnet.", "„Wir sind sehr froh“, sagte die Lehrerin."]


def test_tokenized_compound_split_bleu_of_a_hand_counted_sample():
    # tokenizer.perl -l de splits the final dot, the quotes and the comma off; the hyphens become ##AT##-##AT##:
    assert moses_compound_split(REFS, "de") == [
        "Das Gutach ##AT##-##AT## Zentrum hat am Montag geöffnet .",  # 9 tokens
        "„ Wir sind froh “ , sagte die Ski ##AT##-##AT## Lehrerin .",  # 12 tokens
    ]
    assert moses_compound_split(HYPS, "de") == [
        "Das Gutach Zentrum hat am Montag geöffnet .",  # 8 tokens
        "„ Wir sind sehr froh “ , sagte die Lehrerin .",  # 11 tokens
    ]
    # Matches / hypothesis n-grams, sentence 1 + sentence 2:
    #   1-grams: 8/8 (every word is in the reference)                     + 10/11 (not "sehr")      = 18/19
    #   2-grams: 6/7 (not "Gutach Zentrum")                               + 7/10 (not "sind sehr", "sehr froh",
    #            "die Lehrerin")                                                                      = 13/17
    #   3-grams: 4/6 ("Zentrum hat am" .. "Montag geöffnet .")            + 4/9 ("„ Wir sind", "froh “ ,",
    #            "“ , sagte", ", sagte die")                                                         = 8/15
    #   4-grams: 3/5 ("Zentrum hat am Montag" .. "am Montag geöffnet .")  + 2/8 ("froh “ , sagte",
    #            "“ , sagte die")                                                                    = 5/13
    # Lengths: hypothesis 8 + 11 = 19, reference 9 + 12 = 21: BP = exp(1 - 21/19) = exp(-2/19) = 0.90009.
    # Geometric mean: (18*13*8*5 / (19*17*15*13)) ** (1/4) = (9360 / 62985) ** 0.25 = 0.14861 ** 0.25 = 0.62088.
    # BLEU = 100 * 0.90009 * 0.62088 = 55.88 (multi-bleu.perl: "BLEU = 55.88, 94.7/76.5/53.3/38.5 (BP=0.900, ...)").
    score = tokenized_bleu(HYPS, REFS, "de")
    assert round(score.bleu, 2) == 55.88
    assert score.text == "BLEU = 55.88, 94.7/76.5/53.3/38.5 (BP=0.900, ratio=0.905, hyp_len=19, ref_len=21)"
    assert score.signature.startswith("nrefs:1|case:mixed|tok:moses-de|split:##AT##|smooth:none|sacremoses:")
    assert score.lang == "de"


def test_the_compound_split_changes_the_score():
    """Without the split, "Gutach-Zentrum" and "Ski-Lehrerin" are one token each: the half-right compounds
    earn nothing, and the reference is shorter."""
    # The same tokens without ##AT##: reference 7 + 10 = 17 tokens, hypothesis 19 (longer: BP = 1).
    #   1-grams: 6/8 (not "Gutach", "Zentrum") + 9/11 (not "sehr", "Lehrerin")                    = 15/19
    #   2-grams: 4/7 ("hat am" .. "geöffnet .") + 6/10 (not "sind sehr", "sehr froh", "die Lehrerin",
    #            "Lehrerin .")                                                                      = 10/17
    #   3-grams: 3/6 + 4/9 = 7/15;  4-grams: 2/5 + 2/8 = 4/13
    # BLEU = 100 * (15*10*7*4 / (19*17*15*13)) ** (1/4) = 100 * (4200 / 62985) ** 0.25 = 50.82.
    unsplit_refs = ["Das Gutach-Zentrum hat am Montag geöffnet .", "„ Wir sind froh “ , sagte die Ski-Lehrerin ."]
    unsplit_hyps = [line.replace(" ##AT##-##AT## ", "-") for line in moses_compound_split(HYPS, "de")]
    multi_bleu = BLEU(tokenize="none", smooth_method="none", force=True)
    assert round(multi_bleu.corpus_score(unsplit_hyps, [unsplit_refs]).score, 2) == 50.82
    assert round(tokenized_bleu(HYPS, REFS, "de").bleu, 2) == 55.88


def test_escaping_and_the_split_are_tokenizer_perls():
    """tokenizer.perl's default HTML escaping on both sides, and Perl's non-overlapping s///g: in "3-D-Modell"
    the "D" taken by the first match cannot start the second (lines as tokenizer.perl -l de | perl -ple writes)."""
    lines = ['Tom & Jerry sagten: "Das ist [nicht] <gut>" | Ende.', "Das 3-D-Modell der Nord-Süd-Achse, z.B. hier."]
    assert moses_compound_split(lines, "de") == [
        "Tom &amp; Jerry sagten : &quot; Das ist &#91; nicht &#93; &lt; gut &gt; &quot; &#124; Ende .",
        "Das 3 ##AT##-##AT## D-Modell der Nord ##AT##-##AT## Süd ##AT##-##AT## Achse , z.B. hier .",
    ]
    # The language's rules: English keeps "'s" on its word, German splits every apostrophe.
    assert moses_compound_split(["Peter's Ski-Lehrerin"], "en") == ["Peter &apos;s Ski ##AT##-##AT## Lehrerin"]
    assert moses_compound_split(["Peter's Ski-Lehrerin"], "de") == ["Peter &apos; s Ski ##AT##-##AT## Lehrerin"]
    assert moses_compound_split(["", "   "], "de") == ["", ""]
    with pytest.raises(DataError, match="no language 'xx'"):
        moses_compound_split(["a"], "xx")


def test_zero_matches_of_an_order_give_zero_as_multi_bleu_does():
    # 3 of 3 unigrams, 2 of 2 bigrams, 1 of 1 trigram, no 4-gram at all: no smoothing, so 0.
    assert tokenized_bleu(["a b c"], ["a b c"], "en").bleu == 0.0


def test_the_target_language():
    assert target_language("fr", "de", "test.en") == "fr"  # --lang first
    assert target_language(None, "de", "test.en") == "de"  # then the checkpoint's data.tgt_lang
    assert target_language(None, "yy", "newstest2014.de") == "de"  # then the reference's suffix
    assert target_language(None, "", "newstest2014.de.gz") == "de"
    assert target_language(None, "", "test.ref") == "en"  # else tokenizer.perl's default
    assert target_language(None, "", "-") == "en"


@pytest.fixture
def sample(tmp_path):
    (tmp_path / "sample.de").write_text("\n".join(REFS) + "\n")
    (tmp_path / "sample.hyp").write_text("\n".join(HYPS) + "\n")
    (tmp_path / "short.de").write_text(REFS[0] + "\n")
    return tmp_path


def test_evaluate_scores_a_given_output(run, sample):
    code, out, err = run("evaluate", "--hyp", sample / "sample.hyp", "--ref", sample / "sample.de")
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 4
    assert lines[0].startswith("BLEU|nrefs:1|case:mixed|eff:no|tok:13a|") and lines[0].endswith("(cased BLEU)")
    assert lines[2].startswith("chrF2|")
    assert lines[3] == (
        "tokenized compound-split BLEU = 55.88, 94.7/76.5/53.3/38.5 (BP=0.900, ratio=0.905, hyp_len=19, ref_len=21)"
        "   (Moses tokenizer -l de, ##AT## hyphen split, multi-bleu.perl: the paper's EN-DE metric)"
    )
    code, out, err = run("evaluate", "--hyp", sample / "sample.hyp", "--ref", sample / "sample.de", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["bleu_tokenized"] == 55.8849 and result["sentences"] == 2
    assert result["signature_tokenized"].startswith("nrefs:1|case:mixed|tok:moses-de|")
    assert result["hyp"] == str(sample / "sample.hyp") and "checkpoint" not in result


REFUSALS = [
    (("--hyp", "{hyp}"), "--hyp needs --ref"),
    (("--hyp", "{hyp}", "--ref", "{ref}", "--ckpt", "{ref}"), "--hyp with --ckpt: --hyp scores a given output"),
    (("--hyp", "{hyp}", "--ref", "{ref}", "--input", "{ref}"), "--hyp with --input: --hyp scores a given output"),
    (("--hyp", "{hyp}", "--ref", "{ref}", "--beam", "2", "--tp", "2"), "--hyp with --beam, --tp: "),
    (("--hyp", "{hyp}", "--ref", "{ref}", "--output", "{dir}/out.txt"), "--hyp with --output: "),
    (("--ref", "{ref}"), "--ckpt and --input missing: evaluate needs --ckpt, --input and --ref"),
    (("--hyp", "{hyp}", "--ref", "{short}"), "sample.hyp has 2 lines but {short} has 1"),
    (("--hyp", "-", "--ref", "-"), "--hyp - and --ref -: one stream"),
    (("--hyp", "{hyp}", "--ref", "{ref}", "--lang", "xx"), "argument --lang: invalid choice: 'xx'"),
]


@pytest.mark.parametrize("argv, fragment", REFUSALS, ids=[" ".join(r[0]) for r in REFUSALS])
def test_evaluate_refuses_mixed_or_missing_options_in_one_line(argv, fragment, run, sample):
    names = {"hyp": sample / "sample.hyp", "ref": sample / "sample.de", "short": sample / "short.de", "dir": sample}
    argv = [a.format(**names) for a in argv]
    assert_one_line_error(*run("evaluate", *argv)[::2], fragment.format(**names))


def test_in_training_validation_reports_the_tokenized_bleu_where_asked(tmp_path):
    """train.eval_bleu_tokenized=true: each validation line and record carries bleu_tok beside sacreBLEU's; on
    data whose target language the Moses tokenizer does not know, the run is refused in one line."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from wmt14_tree import build_wmt14_tree

    root = Path(__file__).resolve().parents[1]
    plain = build_wmt14_tree(tmp_path / "raw") / "plain"
    cli = [sys.executable, "-m", "megaformer.cli"]
    prep = [*cli, "prepare", "--src", "en", "--tgt", "de", "--train", str(plain / "train"), "--valid"]
    prep += [str(plain / "newstest2013"), "--vocab-size", "300", "--out", str(tmp_path / "data"), "-q"]
    subprocess.run(prep, check=True, cwd=root)
    sets = ["train.max_steps=4", "train.eval_interval=2", "train.eval_bleu_sentences=8", "data.max_tokens=512"]
    sets += [
        "train.tokens_per_step=512",
        "train.eval_bleu_tokenized=true",
        "train.peak_tflops=0.1",
        "train.log_interval=2",
    ]
    args = ["train", "--config", "configs/tiny.yaml", "--nproc", "1", "--run-dir", str(tmp_path / "run")]
    args += [a for s in sets for a in ("--set", s)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([*cli, *args, "--set", f"data.path={tmp_path / 'data'}"], cwd=root, env=env, text=True,
                         capture_output=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    valid = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in valid if r["kind"] == "valid"]
    assert len(valid) == 2 and all(0 <= r["bleu_tok"] <= 100 for r in valid), valid
    assert "| bleu_tok " in run.stdout
    synthetic = tmp_path / "synthetic"
    subprocess.run([*cli, "prepare", "--synthetic", "100", "--out", str(synthetic), "-q"], check=True, cwd=root)
    other = [*cli, *args, "--set", f"data.path={synthetic}", "--run-dir", str(tmp_path / "run2")]
    refused = subprocess.run(other, cwd=root, env=env, text=True, capture_output=True, timeout=300)
    assert refused.returncode != 0 and "train.eval_bleu_tokenized=true: the Moses tokenizer has no language" in (
        refused.stderr
    ), refused.stderr
