"""Layout arithmetic is checked before any process group exists, with messages that say what to change."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from megaformer.config import ModelConfig, ParallelConfig
from megaformer.errors import ConfigError
from megaformer.parallel import ParallelContext, ParallelLayout, check_model_split, padded_vocab_size


def test_groups_are_contiguous_in_tp():
    layout = ParallelLayout.from_config(ParallelConfig(tp=2), world_size=8)
    assert layout.dp == 4
    assert layout.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.dp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]


@pytest.mark.parametrize(
    "model, tp, words",
    [
        (ModelConfig(num_heads=8, d_model=512), 3, ["num_heads=8", "parallel.tp=3", "[1, 2, 4, 8]"]),
        (ModelConfig(num_heads=6, d_model=384, d_ff=1000), 3, ["d_ff=1000", "parallel.tp=3"]),
        (ModelConfig(num_heads=7, d_model=512), 1, ["d_model=512", "num_heads=7"]),
    ],
)
def test_model_split_errors(model, tp, words):
    with pytest.raises(ConfigError) as err:
        check_model_split(model, tp)
    for w in words:
        assert w in str(err.value)


@pytest.mark.parametrize(
    "cfg, world, words",
    [
        (ParallelConfig(tp=2, dp=3, backend="gloo"), 4, ["2 x 3 = 6", "world size is 4", "parallel.dp=2"]),
        (ParallelConfig(tp=3, backend="gloo"), 4, ["parallel.tp=3", "world size 4"]),
        (ParallelConfig(tp=2, pp=2, backend="gloo"), 6, ["parallel.tp x parallel.pp = 2 x 2 = 4", "world size 6"]),
        (ParallelConfig(tp=1, pp=2, dp=3, backend="gloo"), 4, ["1 x 3 x 2 = 6", "parallel.dp=2"]),
    ],
)
def test_world_size_errors_before_any_group(cfg, world, words):
    with pytest.raises(ConfigError) as err:
        ParallelContext.initialize(cfg, rank=0, world_size=world)
    for w in words:
        assert w in str(err.value)
    assert not dist.is_initialized()


def test_vocab_padding():
    assert padded_vocab_size(37000, 1) == padded_vocab_size(37000, 8) == 37120
    assert padded_vocab_size(8000, 16) % 128 == 0
    assert padded_vocab_size(1000, 32) % 256 == 0  # tp x 8 beyond the default multiple
    assert padded_vocab_size(1024, 4) == 1024


def test_parity_command_rejects_bad_layout_before_starting_processes():
    proc = subprocess.run(
        [sys.executable, "-m", "megaformer.cli", "parity", "--config", "configs/tiny.yaml", "--tp", "3"]
        + ["--set", "parallel.backend=gloo"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 2
    assert "model.num_heads=4 is not divisible by parallel.tp=3" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1


def test_rank_order_is_tp_then_dp_then_pp():
    layout = ParallelLayout.from_config(ParallelConfig(tp=2, pp=2, backend="gloo"), 8)
    assert layout.dp == 2
    assert layout.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.model_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert layout.coordinates(6) == (1, 1, 0)
