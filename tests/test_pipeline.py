"""Pipeline parallelism: the cut, parity with the unsplit model, training, resume and faults (CPU, gloo)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_helpers import ROOT, common, losses, ok, train

from megaformer.config import load_config
from megaformer.errors import ConfigError
from megaformer.model import Transformer
from megaformer.parallel import LOCAL, DropoutRNG
from megaformer.parallel.stages import COPY, OWN, balanced_split, bubble_fraction, plan_stages
from megaformer.pipeline.stage import mask_draws

TINY = ROOT / "configs" / "tiny.yaml"


def sets(corpus: Path, *extra: str) -> list[str]:
    """Four micro-batches per step (2048 tokens in micro-batches of <= 512), 30 steps, checkpoints every 10.

    With tiny's own learning-rate schedule (test_train's runs warm up 4x faster, to show a
    falling loss in 30 steps): see :func:`same_curve` for why the schedule matters here.
    """
    schedule = ["train.lr_scale=0.5", "train.warmup_steps=200"]
    return common(corpus) + ["train.tokens_per_step=2048", "train.max_steps=30", *schedule, *extra]


# ---- the cut ---------------------------------------------------------------------------------------


def test_cut_of_the_layers():
    model = load_config(TINY).model  # 2 encoder + 2 decoder layers
    parts = plan_stages(model, 3, "1,2,1")
    assert [(list(p.encoder), list(p.decoder)) for p in parts] == [([0], []), ([1], [0]), ([], [1])]
    assert [p.embedding for p in parts] == [OWN, COPY, COPY]
    assert [(p.receives_encoder, p.receives_memory, p.receives_decoder) for p in parts] == [
        (False, False, False),
        (True, False, False),
        (False, True, True),
    ]
    assert bubble_fraction(2, 4) == pytest.approx(1 / 5)


def test_balanced_cut_weighs_the_decoder_and_the_output_layer():
    big = load_config(ROOT / "configs" / "transformer_big.yaml").model
    counts = balanced_split(big, 2, 37000)
    assert sum(counts) == 12 and counts[0] > 6  # decoder layers and the output projection cost more


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.pp=5"], "parallel.pp=5 is more than the model's 4 layers"),
        (["parallel.pp=2", "parallel.pp_split=3,2"], "sums to 5 layers but the model has 4"),
        (["parallel.pp=2", "parallel.pp_split=4,0"], "every stage needs at least one layer"),
        (["parallel.pp=3", "parallel.pp_split=2,2"], "names 2 stages but parallel.pp=3"),
        (["parallel.pp=2", "train.zero_stage=2"], "use train.zero_stage=1"),
    ],
)
def test_bad_layouts_are_refused_by_the_config(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, overrides)


def test_bad_layout_fails_before_any_process_starts(corpus, tmp_path):
    proc = train(tmp_path / "run", 2, common(corpus) + ["parallel.pp=2", "parallel.pp_split=1,1"])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "parallel.pp_split='1,1' sums to 2 layers but the model has 4" in lines[0]
    assert not (tmp_path / "run").exists()


def test_mask_draws_count_what_a_forward_draws():
    cfg = load_config(TINY, ["model.attention_dropout=0.1", "model.activation_dropout=0.2", "model.norm=pre"])
    rng = DropoutRNG(1, LOCAL)
    model = Transformer(cfg.model, 200, LOCAL, rng)
    model.train()
    ids = torch.randint(4, 200, (2, 7))
    model.loss(ids, ids, ids)
    assert mask_draws(model) == {"shared": rng.state_dict()["shared"][1], "local": 0}
    stages = [Transformer(cfg.model, 200, LOCAL, DropoutRNG(1, LOCAL), part=p) for p in plan_stages(cfg.model, 3)]
    assert sum(mask_draws(s)["shared"] for s in stages) == mask_draws(model)["shared"]


# ---- parity with the unsplit model ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "layout",
    [
        ["--pp", "2"],
        ["--pp", "4"],
        ["--pp", "2", "--tp", "2"],
        [
            "--pp",
            "3",
            "--set",
            "model.encoder_layers=5",
            "--set",
            "model.decoder_layers=3",
            "--set",
            "parallel.pp_split=3,3,2",
            "--set",
            "model.attention_dropout=0.1",
        ],
        ["--set", "parallel.tp=2", "--set", "parallel.pp=2"],  # without --tp/--pp: the config's (it checked TP=1)
    ],
    ids=["pp2", "pp4", "pp2-tp2", "pp3-uneven", "tp2-pp2-of-the-config"],
)
def test_parity_command(layout):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megaformer.cli",
            "parity",
            "--config",
            str(TINY),
            *layout,
            "--set",
            "parallel.backend=gloo",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS: largest relative difference" in proc.stdout
    if layout[-1] == "parallel.pp=2":  # the config's layout, not TP=1 against itself
        assert "parity TP=2 PP=2 vs TP=1" in proc.stdout, proc.stdout[:500]


# ---- training ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pp1_run(corpus, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("pp1") / "run"
    ok(train(run, 1, sets(corpus)))
    return run


@pytest.fixture(scope="module")
def pp2_run(corpus, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("pp2") / "run"
    ok(train(run, 2, sets(corpus, "parallel.pp=2")))
    return run


def same_curve(a: Path, b: Path, steps: range, tolerance: float = 1e-5) -> None:
    """Every loss of ``steps`` within ``tolerance`` (relative).

    Every parameter but the shared embedding gets bitwise the unsplit model's gradient
    (checked once by hand: after step 1 all other tensors were equal). The embedding's
    three uses are added in another order (the copies' step sums last), and Adam (eps
    1e-9) turns those last-bit differences of near-zero gradient elements into a drift
    that grows with the learning rate: 1.5e-6 over these 30 steps, 5e-5 with test_train's
    4x faster warm-up.
    """
    one, two = losses(a), losses(b)
    for step in steps:
        assert abs(one[step]["loss"] - two[step]["loss"]) <= tolerance * abs(two[step]["loss"]), step


def test_pp2_loss_curve_equals_pp1(pp1_run, pp2_run):
    """30 steps of 4 micro-batches, fp32, dropout on: the pipeline trains the same run."""
    same_curve(pp2_run, pp1_run, range(1, 31))
    curve = losses(pp2_run)
    assert curve[30]["loss"] < curve[1]["loss"] - 0.5  # a run that learns, not a flat line
    assert curve[30]["pipeline_wait"] > 0


def test_pp2_tp2_loss_curve_equals_pp1(corpus, pp1_run, tmp_path):
    run = tmp_path / "run"
    ok(train(run, 4, sets(corpus, "parallel.pp=2", "parallel.tp=2", "train.save_interval=0")))
    same_curve(run, pp1_run, range(1, 31))


def test_zero1_over_each_stage_and_global_clipping(corpus, tmp_path):
    """pp=2 x dp=2 with ZeRO-1 and gradient clipping follows pp=1 x dp=2: the clipping norm spans both stages."""
    extra = ("train.zero_stage=1", "train.clip_grad=0.5", "train.max_steps=10", "train.save_interval=0")
    one, two = tmp_path / "pp1", tmp_path / "pp2"
    ok(train(one, 2, sets(corpus, *extra)))
    ok(train(two, 4, sets(corpus, "parallel.pp=2", *extra)))
    same_curve(two, one, range(1, 11))
    assert all(r["grad_norm"] > 0.5 for r in losses(one).values())  # clipping was active on every step


def test_validation_through_the_pipeline_equals_pp1(corpus, tmp_path):
    """Validation loss and perplexity at pp=2 (one forward per batch through both stages) equal pp=1's."""
    extra = ("train.max_steps=4", "train.save_interval=0", "train.eval_interval=4", "train.eval_bleu_sentences=0")
    records = []
    for pp in (1, 2):
        run = tmp_path / f"pp{pp}"
        ok(train(run, pp, sets(corpus, f"parallel.pp={pp}", *extra)))
        lines = (run / "metrics.jsonl").read_text().splitlines()
        records.append([r for r in map(json.loads, lines) if r["kind"] == "valid"][-1])
    one, two = records
    assert two["tokens"] == one["tokens"]
    for key in ("loss", "nll"):
        assert abs(two[key] - one[key]) <= 1e-5 * one[key], key


def test_activation_checkpointing_in_a_pipeline(corpus, pp1_run, tmp_path):
    run = tmp_path / "run"
    extra = ("parallel.pp=2", "model.activation_checkpointing=true", "train.max_steps=10", "train.save_interval=0")
    ok(train(run, 2, sets(corpus, *extra)))
    same_curve(run, pp1_run, range(1, 11))


def test_kill_and_resume_a_pipeline_is_exact(corpus, pp2_run, tmp_path):
    run = tmp_path / "run"
    first = train(run, 2, sets(corpus, "parallel.pp=2"), fault="kill:rank=1:step=13")
    assert first.returncode != 0
    second = train(run, 2, sets(corpus, "parallel.pp=2"))
    ok(second)
    assert "resumed from" in second.stdout and "step-00000010" in second.stdout
    resumed, reference = losses(run), losses(pp2_run)
    assert sorted(resumed) == list(range(1, 31))
    for step in range(1, 31):
        assert resumed[step]["loss"] == reference[step]["loss"], step


@pytest.mark.parametrize("pp, tp", [(1, 1), (4, 1), (1, 2)])
def test_resume_a_pipeline_at_another_pp(corpus, pp2_run, tmp_path, pp, tp):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(pp2_run / "checkpoints" / "step-00000010", run / "checkpoints" / "step-00000010")
    layout = (f"parallel.pp={pp}", f"parallel.tp={tp}", "train.max_steps=12", "train.save_interval=0")
    proc = train(run, pp * tp, sets(corpus, *layout))
    ok(proc)
    assert f"pp=2 -> tp={tp} dp=1 pp={pp}" in proc.stdout
    same_curve(run, pp2_run, range(11, 13))  # Adam's moments, data position and dropout masks carried


def test_fp16_overflow_on_one_stage_skips_every_stage(corpus, tmp_path):
    """An infinite gradient on stage 0 only: both stages skip the step (their weights stay as they were)."""
    from megaformer.checkpoint import read_shard

    run = tmp_path / "run"
    extra = (
        "parallel.pp=2",
        "train.precision=fp16",
        "train.zero_stage=1",
        "train.fp16_hysteresis=1",
        "train.max_steps=9",
        "train.save_interval=1",
        "train.keep_last=3",
    )
    ok(train(run, 2, sets(corpus, *extra), fault="overflow:rank=0:step=8"))
    curve = losses(run)
    assert curve[7]["skipped_steps"] == 0 and curve[8]["skipped_steps"] == 1
    assert curve[8]["loss_scale"] == curve[7]["loss_scale"] / 2

    for stage in (0, 1):
        name = f"model-pp{stage:02d}-of-02-tp00-of-01.pt"
        before, after, later = (
            read_shard(d, json.loads((d / "meta.json").read_text()), name)["param"]
            for d in (run / "checkpoints" / f"step-{s:08d}" for s in (7, 8, 9))
        )
        assert all(torch.equal(before[n], after[n]) for n in before), f"stage {stage} stepped on the overflow"
        assert not all(torch.equal(after[n], later[n]) for n in after), f"stage {stage} did not step after it"


def test_pipelined_checkpoint_exports_and_translates(pp2_run, tmp_path):
    from megaformer.checkpoint import consolidate
    from megaformer.model.shape import shape_model

    model = consolidate(pp2_run / "checkpoints" / "step-00000030")
    names = {n for n, _ in shape_model(model.config, model.vocab_size).named_parameters()}
    assert set(model.model) == names
    src = tmp_path / "src.txt"
    src.write_text("a b c\nd e\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megaformer.cli",
            "translate",
            "--ckpt",
            str(pp2_run),
            "--input",
            str(src),
            "--output",
            str(tmp_path / "out.txt"),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert len((tmp_path / "out.txt").read_text().splitlines()) == 2
