"""benchmarks/gpu.sh's plan and time limits, and what its GPU benchmarks build on the device, without a GPU.

A GPU's time is short: the script says its plan, refuses one over its limits before anything runs,
and stops a check at its budget so that the others still run. host_overhead.py's reference and
data_stream.py's helpers are checked where a CPU can check them (the meta device holds no host
tensor: a tensor made on the CPU inside the reference fails there as it would on CUDA).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_helpers import assert_one_line_error

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu.sh"
sys.path.insert(0, str(ROOT / "benchmarks"))


def gpu_sh(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("BUDGET_", "MIN_MFU_", "CHECKS", "GPU_SH_"))}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env={**clean, **env}
    )


def plan_of(stdout: str) -> tuple[list[tuple[str, int]], int]:
    """(check, seconds) per line and the total of ``--plan``'s output."""
    lines = stdout.strip().splitlines()
    checks = [(line.split()[0], int(line.split()[1])) for line in lines[:-1]]
    assert lines[-1].startswith("total "), stdout
    return checks, int(lines[-1].split()[1])


@pytest.mark.parametrize(("args", "limit"), [((), 480), (("--dry",), 1200)], ids=["gpu", "dry"])
def test_the_plan_runs_the_most_informative_check_first_within_the_limits(args, limit):
    proc = gpu_sh("--plan", *args)
    assert proc.returncode == 0, proc.stderr
    checks, total = plan_of(proc.stdout)
    assert [c for c, _ in checks] == ["d", "a", "b", "c"]
    assert total == sum(s for _, s in checks) <= limit
    assert all(s <= 540 for _, s in checks)


def test_the_plan_follows_checks_order_and_d_runs_alone():
    checks, total = plan_of(gpu_sh("--plan", CHECKS="d").stdout)
    assert [c for c, _ in checks] == ["d"] and total == checks[0][1]
    assert [c for c, _ in plan_of(gpu_sh("--plan", CHECKS="ca").stdout)[0]] == ["c", "a"]


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"BUDGET_D": "600"}, "check d's budget is 600 s, over the 540 s a check may take: lower BUDGET_D"),
        ({"BUDGET_A": "300"}, "takes 690 s by its budgets, over the 480 s a run may take"),
        ({"BUDGET_B": "1m"}, "BUDGET_B=1m: give check b's budget in whole seconds"),
        ({"CHECKS": "dd"}, "CHECKS=dd: name the checks to run with the letters a, b, c and d, each once"),
    ],
)
def test_a_plan_over_its_limits_is_refused_in_one_line(env, fragment):
    proc = gpu_sh("--plan", **env)
    assert_one_line_error(proc.returncode, proc.stderr, fragment)
    assert proc.stdout == ""


def test_a_bad_mfu_threshold_is_refused_before_anything_runs(tmp_path):
    proc = gpu_sh(MIN_MFU_BIG="40%", WORK=str(tmp_path / "work"))
    assert_one_line_error(proc.returncode, proc.stderr, "MIN_MFU_BIG=40%: give the lowest MFU to accept")
    assert not (tmp_path / "work").exists()


def test_a_check_over_its_budget_is_stopped_and_fails_and_the_summary_says_so(tmp_path):
    """check d alone with a 2-second budget: the corpus it prepares first takes longer."""
    began = time.monotonic()
    proc = gpu_sh("--dry", timeout=120, DEVICE="cpu", CHECKS="d", BUDGET_D="2", WORK=str(tmp_path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = proc.stdout.split("summary (")[1]
    assert "FAIL d: stopped at its budget of 2 s" in summary
    assert "time by check (budget): d " in summary
    assert time.monotonic() - began < 60


def test_a_signal_to_the_script_stops_the_running_check_and_prints_the_summary(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BUDGET_", "CHECKS", "GPU_SH_"))}
    env.update(DEVICE="cpu", CHECKS="d", WORK=str(tmp_path))
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), "--dry"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        for line in proc.stdout:
            if line.startswith("-- check d"):
                break
        time.sleep(2)  # the child is preparing the corpus
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 124, out
    assert "FAIL d: stopped by a signal" in out.split("summary (")[1]


@pytest.mark.parametrize("shape", ["tiny", "big"])
def test_host_overhead_reference_makes_every_tensor_on_the_run_device(shape):
    """The reference built its causal mask on the CPU, which crashed ``--device cuda`` at once."""
    import host_overhead as ho

    from megaformer.config import load_config

    meta = torch.device("meta")
    with meta:
        ref = ho.Reference(1000, ho.SHAPES[shape])
    plain = ho.PlainLoop(ref, load_config(ROOT / "configs" / "tiny.yaml").train, "bf16", meta)
    src = torch.randint(1, 1000, (3, 7), device=meta)
    tgt = torch.randint(1, 1000, (3, 9), device=meta)
    (ref.loss(src, tgt, tgt) / 27).backward()
    assert {p.device for p in ref.parameters()} == {meta}
    assert {p.dtype for p in ref.parameters()} == {torch.bfloat16}
    assert {(m.device, m.dtype, m.grad.device) for m in plain.master} == {(meta, torch.float32, meta)}


@pytest.mark.parametrize(
    ("engine", "precision", "zero", "clip", "reads"),
    [
        ("lean optimizer", "bf16", 1, 0.0, 1),
        ("deepspeed zero=0", "fp32", 0, 0.0, 1),  # tests/test_engine.py holds these two
        ("deepspeed zero=1", "bf16", 1, 0.0, 2),
        ("deepspeed zero=1", "bf16", 1, 1.0, 3),
        ("deepspeed zero=2", "bf16", 2, 0.0, 3),
    ],
)
def test_host_overhead_reads_target_follows_the_engine(engine, precision, zero, clip, reads):
    import host_overhead as ho

    assert ho.reads_target(engine, precision, zero, clip) == reads


def test_data_stream_reads_the_simulation_json_indented_or_on_its_last_line():
    import data_stream as ds

    assert ds.json_of('{\n "target_tokens_per_s": 5\n}\n')["target_tokens_per_s"] == 5
    assert ds.json_of('calibrating\n{"target_tokens_per_s": 7}\n')["target_tokens_per_s"] == 7
    assert ds.gpu_rate(1234.0) == (1234.0, "--target-tokens-per-s")


def test_data_stream_dispatch_loop_counts_its_work():
    import data_stream as ds

    dispatch = ds.Dispatch()
    assert dispatch.run(0.05) > 10
    assert dispatch.alone(0.05) > 100
