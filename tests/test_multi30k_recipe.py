"""``make multi30k``'s choices (megaformer/recipes/multi30k.py): the settings for the machine and the minutes,
the commands in order, and the refusals before anything runs. Nothing trains here (``--dry-run``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megaformer.errors import ConfigError, DataError
from megaformer.recipes.multi30k import Machine, Multi30k, choose, steps
from megaformer.train.schedule import inverse_sqrt_lr

ROOT = Path(__file__).resolve().parents[1]
CPU_FP32, CPU_BF16, GPU = Machine(gpus=0, native_bf16=False), Machine(gpus=0, native_bf16=True), Machine(1, False)


def _data(folder: Path, tests: dict[str, str] | None = None) -> Path:
    """A DATA folder: empty files of each test set, NAME -> suffix ('' or '.gz')."""
    folder.mkdir(exist_ok=True)
    for name, suffix in (tests or {"test_2016_flickr": ".gz"}).items():
        for lang in ("en", "de"):
            (folder / f"{name}.{lang}{suffix}").write_bytes(b"")
    return folder


def _peak_lr(choices) -> float:
    """The lr at the end of the warm-up (d_model 256, configs/multi30k.yaml)."""
    return inverse_sqrt_lr(choices.warmup_steps, 256, choices.warmup_steps, choices.lr_scale)


def _dry_run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "megaformer.cli", "multi30k", "--dry-run", *args]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_the_precision_follows_the_machine():
    assert choose("15", CPU_BF16).precision == "bf16" and choose("15", GPU).precision == "bf16"
    assert choose("15", CPU_FP32).precision == "fp32"
    assert choose("15", CPU_BF16, precision="fp32").precision == "fp32"  # M30K_PRECISION wins


def test_a_short_fp32_run_takes_the_short_recipe():
    short = choose("15", CPU_FP32)  # ~675 steps of 3,000 tokens expected
    assert (short.tokens_per_step, short.norm, short.dropout, short.warmup_steps) == (1000, "pre", 0.1, 400)
    assert short.cooldown_fraction == 0 and _peak_lr(short) == pytest.approx(2.2e-3, rel=1e-3)


def test_fp32_through_onednn_takes_the_fp32_hours_recipe_in_15_minutes():
    fast = choose("15", Machine(gpus=0, native_bf16=True, onednn_fp32=True), precision="fp32")  # ~1,350 expected
    assert (fast.tokens_per_step, fast.norm, fast.dropout, fast.warmup_steps) == (1000, "pre", 0.15, 1000)
    assert fast.lr_scale == 1.1132 and choose("15", CPU_FP32).lr_scale == 0.704


def test_an_fp32_hour_warms_up_longer_with_small_steps():
    hour = choose("60", CPU_FP32)  # ~2,700 steps expected
    assert (hour.tokens_per_step, hour.norm, hour.dropout, hour.warmup_steps) == (1000, "pre", 0.15, 1000)
    assert hour.lr_scale == 1.1132 and _peak_lr(hour) == pytest.approx(2.2e-3, rel=1e-3)


def test_a_short_bf16_cpu_run_ramps_the_lr_down_and_the_hour_does_not():
    short = choose("15", CPU_BF16)  # ~1,900 steps: the ramp over the last 30 %, a peak of 2.4e-3
    assert (short.tokens_per_step, short.norm, short.dropout, short.cooldown_fraction) == (3000, "post", 0.15, 0.3)
    assert _peak_lr(short) == pytest.approx(2.4e-3, rel=1e-3)
    hour = choose("60", CPU_BF16)  # ~7,500 steps: dropout 0.25, the plain decay from 1.6e-3
    assert (hour.tokens_per_step, hour.norm, hour.dropout, hour.cooldown_fraction) == (3000, "post", 0.25, 0)
    assert _peak_lr(hour) == pytest.approx(1.6e-3, rel=2e-3)


def test_a_gpu_keeps_the_long_settings_even_for_five_minutes():
    gpu = choose("5", GPU)  # ~10,000 steps expected
    assert (gpu.tokens_per_step, gpu.norm, gpu.dropout, gpu.cooldown_fraction, gpu.lr_scale) == (
        3000,
        "post",
        0.25,
        0,
        0.512,
    )


@pytest.mark.parametrize("minutes", ["abc", "", "0", "-5", "1e2"])
def test_minutes_that_are_not_a_positive_number_are_refused(minutes):
    with pytest.raises(ConfigError, match=re.escape(f"MINUTES={minutes} (--minutes): the training minutes")):
        choose(minutes, CPU_BF16)


def test_the_commands_in_order_with_each_test_set_scored(tmp_path):
    data = _data(tmp_path / "data", {"test_2016_flickr": ".gz", "test_2017_mscoco": ""})
    plan = steps(Multi30k(data, ROOT / "runs" / "multi30k", "15", ("test_2016_flickr", "test_2017_mscoco")), CPU_FP32)
    shown = [step.shown() for step in plan]
    assert [s.split()[1] for s in shown] == ["prepare", "train", "average", "evaluate", "evaluate"]
    assert f"--test {data}/test_2016_flickr " in shown[0] and "--vocab-size 8000" in shown[0]
    assert "--run-dir runs/multi30k/run-15m --nproc 2 --resume auto" in shown[1]
    assert "train.max_minutes=15 --set train.save_minutes=0.625" in shown[1]
    assert "--last 5 --run-dir runs/multi30k/run-15m --out runs/multi30k/averaged-15m.pt" in shown[2]
    for line, (name, suffix) in zip(shown[3:], (("test_2016_flickr", ".gz"), ("test_2017_mscoco", ""))):
        assert f"--input {data}/{name}.en{suffix} --ref {data}/{name}.de{suffix}" in line
        assert f"--output runs/multi30k/{name}-15m.hyp" in line
    hour = steps(Multi30k(data, ROOT / "runs" / "multi30k", "60"), CPU_FP32)
    assert "--run-dir runs/multi30k/run " in hour[1].shown() + " "  # the hour keeps the untagged names


def test_missing_or_doubled_test_sets_and_a_missing_folder_are_refused_before_anything_runs(tmp_path):
    data = _data(tmp_path, {"test_2016_flickr": ".gz", "test_2017_mscoco": ""})
    with pytest.raises(DataError, match="has no test_2018_flickr.en"):
        steps(Multi30k(data, tmp_path / "w", "15", ("test_2016_flickr", "test_2018_flickr")), CPU_FP32)
    (data / "test_2017_mscoco.de.gz").write_bytes(b"")
    with pytest.raises(DataError, match="has test_2017_mscoco.de both plain and .gz"):
        steps(Multi30k(data, tmp_path / "w", "15", ("test_2017_mscoco",)), CPU_FP32)
    with pytest.raises(DataError, match="no such folder"):
        steps(Multi30k(tmp_path / "nowhere", tmp_path / "w"), CPU_FP32)
    with pytest.raises(DataError, match="TESTS is empty"):
        steps(Multi30k(data, tmp_path / "w", "15", ()), CPU_FP32)


def test_make_multi30k_trains_on_a_listed_gpu_and_on_the_cpu_otherwise(tmp_path):
    """Through the command, as make calls it: nvidia-smi's list decides, --gpus 0 overrides it."""
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "GPU 0: NVIDIA H200 (UUID: GPU-00000000)"\n')
    fake.chmod(0o755)
    data = _data(tmp_path / "data")
    env = {**os.environ, "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}"}
    gpu = _dry_run("--data", str(data), "--minutes", "5", env=env)
    assert gpu.returncode == 0, gpu.stderr
    assert "--nproc 1 --set parallel.device=cuda --set data.max_tokens=3072" in gpu.stdout, gpu.stdout
    assert "--run-dir runs/multi30k/run-5m" in gpu.stdout
    cpu = _dry_run("--data", str(data), "--minutes", "5", "--gpus", "0", "--precision", "fp32", env=env)
    assert "--nproc 2" in cpu.stdout and "parallel.device" not in cpu.stdout, cpu.stdout
    bad = _dry_run("--data", str(data), "--minutes", "abc")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "MINUTES=abc" in bad.stderr, bad.stderr


def test_the_make_target_holds_no_policy():
    """make only passes arguments: no awk, no hyper-parameter (the recipe module chooses them)."""
    makefile = (ROOT / "Makefile").read_text()
    target = makefile.split("\nmulti30k: install\n", 1)[1].split("\n\n", 1)[0]
    assert "awk" not in makefile and "megaformer.cli multi30k" in target
    assert not re.search(r"dropout|lr_scale|warmup|tokens_per_step|norm=|precision=", target), target
