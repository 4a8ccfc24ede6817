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
