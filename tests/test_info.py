"""`megaformer info`: the paper's parameter counts and the JSON keys."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megaformer.config import load_config
from megaformer.info import model_info

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("preset, paper", [("transformer_base", 65e6), ("transformer_big", 213e6)])
def test_parameter_counts_match_the_paper(preset, paper):
    info = model_info(load_config(ROOT / "configs" / f"{preset}.yaml", ["data.vocab_size=37000"]))
    assert abs(info["parameters"] - paper) / paper < 0.04, info["parameters"]
    assert info["flops_per_token"] == 6 * info["parameters"]


def test_per_rank_parameters_shrink_with_tp():
    one = model_info(load_config(ROOT / "configs" / "transformer_big.yaml", ["parallel.tp=1"]))
    eight = model_info(load_config(ROOT / "configs" / "transformer_big.yaml", ["parallel.tp=8"]))
    assert one["parameters"] == eight["parameters"]
    # Everything but LayerNorms and row-parallel biases is split 8 ways.
    assert one["parameters_per_rank"] / 8 < eight["parameters_per_rank"] < one["parameters_per_rank"] / 7.9
    assert eight["memory_per_rank_bytes"]["total"] < one["memory_per_rank_bytes"]["total"]


def test_info_command_json():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megaformer.cli",
            "info",
            "--config",
            "configs/transformer_big.yaml",
            "--set",
            "data.vocab_size=37000",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    for key in ("parameters", "parameters_per_rank", "flops_per_token", "memory_per_rank_bytes"):
        assert key in info
    assert 205e6 < info["parameters"] < 222e6


def test_info_command_rejects_bad_layout():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megaformer.cli",
            "info",
            "--config",
            "configs/transformer_base.yaml",
            "--set",
            "parallel.tp=3",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "num_heads=8 is not divisible by parallel.tp=3" in proc.stderr and "Traceback" not in proc.stderr


def test_layout_estimate_counts_bytes_independently():
    """The TP and DP bytes of the estimate, recounted by hand for transformer_big on 4 nodes of 8 GPUs."""
    from megaformer.info import compare_layouts

    cfg = load_config(ROOT / "configs" / "transformer_big.yaml", ["data.vocab_size=37000"])
    rows = {r["tp"]: r for r in compare_layouts(cfg, 32)}
    assert sorted(rows) == [1, 2, 4, 8]
    # TP=8, dp=4: 25000 / 4 tokens per GPU, 1024 wide, bf16; 6 encoder layers x 4 + 6 decoder layers x 6
    # + 2 embeddings + 1 output projection = 63 all-reduces, each moving 2 x 7/8 of the tensor.
    assert rows[8]["tp_bytes"] == pytest.approx(63 * 2 * 7 / 8 * 6250 * 1024 * 2)
    assert rows[1]["tp_bytes"] == 0
    # Gradients in fp32 are reduced over the node's rails: every tp sends P/8 x 4 bytes x 2 x 3/4 per NIC.
    nic = {tp: r["dp_nic_bytes"] for tp, r in rows.items()}
    per_rank = {tp: model_info(load_config(ROOT / "configs" / "transformer_big.yaml", [f"parallel.tp={tp}"]))
                for tp in rows}  # fmt: skip
    for tp in rows:
        assert nic[tp] == pytest.approx(per_rank[tp]["parameters_per_rank"] * 4 * 1.5 / (8 // tp))
    assert rows[8]["dp_nvlink_bytes"] == 0 and rows[1]["dp_nvlink_bytes"] > rows[2]["dp_nvlink_bytes"]
    # One node: no inter-node traffic at all.
    assert all(r["dp_nic_bytes"] == 0 for r in compare_layouts(cfg, 8))


def test_big_preset_default_is_the_estimate_fastest_for_the_slurm_script():
    """configs/transformer_big.yaml's tp is the fastest estimated layout for 4 nodes x 8 GPUs; TP=8 one override."""
    from megaformer.info import compare_layouts, fastest

    cfg = load_config(ROOT / "configs" / "transformer_big.yaml", ["data.vocab_size=37000"])
    best = fastest(compare_layouts(cfg, 32))
    assert cfg.parallel.tp == best["tp"] and cfg.parallel.dp == 0 and cfg.train.zero_stage == 1
    assert load_config(ROOT / "configs" / "transformer_big.yaml", ["parallel.tp=8"]).parallel.tp == 8


def test_info_prints_the_layout_table():
    proc = subprocess.run(
        [sys.executable, "-m", "megaformer.cli", "info", "--config", "configs/transformer_big.yaml", "--world", "32"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "layouts for 32 GPUs" in proc.stdout and "<- fastest" in proc.stdout
    assert "1 micro-batch of <= 3125 tokens per DP rank" in proc.stdout  # tp=4 x dp=8


def test_a_refused_layout_says_why():
    """tiny's 2,048-token steps cannot be split over 32 DP ranks: the row says refused and a line says why."""
    argv = [sys.executable, "-m", "megaformer.cli", "info", "--config", "configs/tiny.yaml", "--world", "32"]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "refused at tp=1 dp=32: train.tokens_per_step=2048 over 32 data streams" in proc.stdout, proc.stdout


def _pipeline(preset: str, *sets: str) -> tuple[dict, dict]:
    from megaformer.info import pipeline_info, step_info

    cfg = load_config(ROOT / "configs" / f"{preset}.yaml", ["data.vocab_size=37000", *sets])
    m = step_info(cfg, max(1, cfg.parallel.dp))["micro_batches_per_step"]
    return model_info(cfg), pipeline_info(cfg, m)


@pytest.mark.parametrize("pp, tp", [(2, 1), (3, 1), (4, 2), (12, 1)])
def test_stage_parameters_sum_to_the_model(pp, tp):
    """Every parameter on exactly one stage; the embedding's copies are buffers, counted apart."""
    whole, pipe = _pipeline("transformer_big", f"parallel.pp={pp}", f"parallel.tp={tp}")
    stages = pipe["stages"]
    assert len(stages) == pp
    assert sum(s["parameters"] for s in stages) == whole["parameters"]
    table = whole["padded_vocab_size"] * 1024 // tp  # the embedding table as one TP rank holds it
    assert stages[0]["embedding"] == "own" and stages[0]["embedding_copy"] == 0
    assert stages[-1]["embedding"] == "copy" and stages[-1]["embedding_copy"] == table
    copies = sum(s["embedding_copy"] for s in stages)
    assert copies == table * sum(s["embedding"] == "copy" for s in stages)
    # Per TP rank, the stages hold the whole model's rank shard, no more (shared LayerNorms and biases included).
    assert sum(s["parameters_per_rank"] for s in stages) == whole["parameters_per_rank"]


@pytest.mark.parametrize("p, m", [(2, 4), (2, 8), (4, 6), (1, 3)])
def test_bubble_is_the_1f1b_formula(p, m):
    from megaformer.parallel.stages import bubble_fraction

    assert bubble_fraction(p, m) == pytest.approx((p - 1) / (m + p - 1))


def test_pipeline_bubble_and_in_flight_micro_batches():
    # 25000 tokens in micro-batches of 4096 at dp=1: 6 micro-batches per step.
    _, pipe = _pipeline("transformer_big", "parallel.pp=4", "parallel.tp=1", "data.max_tokens=4096")
    assert pipe["micro_batches_per_step"] == 6
    assert pipe["bubble_fraction"] == pytest.approx(3 / 9)
    assert [s["micro_batches_in_flight"] for s in pipe["stages"]] == [4, 3, 2, 1]
    # Fewer micro-batches than stages: no stage holds more than there are.
    _, few = _pipeline("tiny", "parallel.pp=4")
    assert few["micro_batches_per_step"] == 2
    assert [s["micro_batches_in_flight"] for s in few["stages"]] == [2, 2, 2, 1]
    for s in pipe["stages"]:
        mem = s["memory_per_rank_bytes"]
        assert mem["total"] == pytest.approx(sum(v for k, v in mem.items() if k != "total"), abs=4)


def test_uneven_split_shows_in_the_stages():
    whole, pipe = _pipeline("transformer_base", "parallel.pp=2", "parallel.pp_split=3,9")
    first, second = pipe["stages"]
    assert pipe["pp_split"] == "3,9"
    assert first["layers"] == "encoder 0-2" and second["layers"] == "encoder 3-5 + decoder 0-5"
    # The second stage starts the decoder and ends the model: one copy of the table serves both.
    assert second["embedding"] == "copy" and second["embedding_copy"] == whole["padded_vocab_size"] * 512
    assert first["parameters"] + second["parameters"] == whole["parameters"]
    assert second["memory_per_rank_bytes"]["activations"] > first["memory_per_rank_bytes"]["activations"] * 1.5


def test_info_prints_the_pipeline_stages():
    proc = subprocess.run(
        [sys.executable, "-m", "megaformer.cli", "info", "--config", "configs/transformer_big.yaml",
         "--set", "parallel.pp=2", "--set", "parallel.pp_split=5,7", "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["layout"]["pp"] == 2
    assert [s["layers"] for s in info["pipeline"]["stages"]] == ["encoder 0-4", "encoder 5 + decoder 0-5"]
    text = subprocess.run(
        [sys.executable, "-m", "megaformer.cli", "info", "--config", "configs/transformer_big.yaml",
         "--set", "parallel.pp=2"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    ).stdout  # fmt: skip
    assert "bubble (p - 1) / (m + p - 1)" in text and "stage 1" in text and "embedding copy" in text
    assert "in flight on stage i" in text


def test_info_rejects_more_stages_than_layers():
    proc = subprocess.run(
        [sys.executable, "-m", "megaformer.cli", "info", "--config", "configs/tiny.yaml", "--set", "parallel.pp=5"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "parallel.pp=5" in lines[0] and "Traceback" not in proc.stderr, proc.stderr


def _info(*argv: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "megaformer.cli", "info", *argv], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_world_sets_the_dp_size_of_the_memory_and_step_lines():
    """``--world 8`` with tp=4 and dp=0 is dp=2: ZeRO shards over 2 and each rank's micro-batch is half the step.

    The lines said dp=1 and the whole step's activations whatever --world was.
    """
    big = ("--config", "configs/transformer_big.yaml", "--set", "data.vocab_size=37000")
    alone, eight = _info(*big, "--set", "parallel.tp=4"), _info(*big, "--world", "8")
    assert "(ZeRO-1 over dp=1)" in alone and "1 micro-batch of <= 25000 tokens per DP rank" in alone
    assert "(ZeRO-1 over dp=2)" in eight and "1 micro-batch of <= 12500 tokens per DP rank" in eight
    assert "micro-batches of 12500 tokens" in eight
    json_eight = json.loads(_info(*big, "--world", "8", "--json"))
    json_alone = json.loads(_info(*big, "--json"))
    assert json_eight["layout"]["dp"] == 2 and json_alone["layout"]["dp"] == 1
    ratio = json_eight["memory_per_rank_bytes"]["activations"] / json_alone["memory_per_rank_bytes"]["activations"]
    assert abs(ratio - 0.5) < 0.01, ratio  # the estimate is linear in the micro-batch's sequences
    # The table's row for the configured layout is the header's.
    row = next(r for r in json_eight["layouts"]["estimates"] if r["tp"] == 4)
    assert row["memory_per_rank_bytes"] == json_eight["memory_per_rank_bytes"]["total"]


def test_a_world_the_layout_cannot_fill_is_said_and_the_table_still_printed():
    out = _info("--config", "configs/transformer_big.yaml", "--world", "6")
    assert "on 6 GPUs         refused: the configured layout (parallel.tp=4 x parallel.pp=1) needs 4 GPUs" in out
    assert "layouts for 6 GPUs" in out and "(ZeRO-1 over dp=1)" in out
    out = _info("--config", "configs/transformer_big.yaml", "--world", "16", "--set", "parallel.dp=2")
    assert "x parallel.dp=2) runs on 8 GPUs" in out


def test_the_configured_mark_needs_the_configured_dp_too():
    """tp=2 dp=2 on 2 GPUs is not the table's tp=2 dp=1 row (the mark compared tp alone)."""
    out = _info("--config", "configs/tiny.yaml", "--set", "parallel.tp=2", "--set", "parallel.dp=2", "--world", "2")
    assert "<- configured" not in out and "runs on 4 GPUs" in out
    assert "<- configured" in _info("--config", "configs/tiny.yaml", "--set", "parallel.tp=2", "--world", "2")
