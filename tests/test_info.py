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
    assert "micro-batches of <=" in proc.stdout
