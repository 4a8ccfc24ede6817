"""``megaformer plan``: its JSON on a small cluster, its one-line refusals, and collectives predicted as run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megaformer.cli", "plan", "--config", str(TINY), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


def test_plan_json_has_the_layouts_and_one_fastest():
    done = _plan("--nodes", "1", "--gpus-per-node", "2", "--gpu", "h100", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    keys = {"tp", "pp", "dp", "zero", "activation_checkpointing", "micro_tokens", "memory_gib", "step_ms"}
    assert all(keys | {"tokens_per_s", "fits"} <= set(r) for r in result["layouts"])
    assert sum(bool(r.get("fastest")) for r in result["layouts"]) == 1
    assert result["fastest"]["fits"] and all(r["tp"] * r["pp"] * r["dp"] == 2 for r in result["layouts"])
    from megaformer.config import load_config

    for r in result["layouts"]:  # each layout's --set values give the trainer that layout
        cfg = load_config(TINY, r["overrides"])
        assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.train.zero_stage) == (
            r["tp"], r["pp"], r["dp"], r["zero"]
        )  # fmt: skip
        assert cfg.data.max_tokens == r["micro_tokens"]
    assert result["command"].startswith("sbatch --nodes=1 slurm/train_big.sh --set parallel.tp=")


@pytest.mark.parametrize(
    "args, says",
    [
        (["--nodes", "0"], "--nodes"),
        (["--gpus-per-node", "0"], "--gpus-per-node"),
        (["--set", "model.num_heads=3"], "model.num_heads"),
        (["--gpu-memory-gb", "0.0001"], "no layout fits"),
    ],
)
def test_invalid_requests_end_in_one_line(args, says):
    done = _plan("--gpus-per-node", "2", *args) if "--gpus-per-node" not in args else _plan(*args)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], done.stderr


def test_predicted_collectives_equal_measured(tmp_path):
    from megaformer.config import load_config
    from megaformer.plan.measure import measure
    from megaformer.plan.price import pieces
    from megaformer.plan.rank import predict_rank
    from megaformer.plan.trace import trace_layers
    from megaformer.sim.deepspeed import fake_world
    from megaformer.sim.roofline import GPUS
    from megaformer.sim.step import MicroShape

    sets = ["parallel.dp=2", "train.zero_stage=1", "model.encoder_layers=1", "model.decoder_layers=1"]
    shape = MicroShape(4, 8, 8)
    measured = measure(str(TINY), sets, 2, [shape] * 2, 1, tmp_path)
    cfg = load_config(TINY, [*sets, "parallel.backend=gloo", "parallel.device=cpu"])
    with fake_world(2):
        traces = trace_layers(cfg, 2, 1, False, shape, "cpu")
    predicted = predict_rank(cfg, pieces(traces, GPUS["h100"]), shape, 2, 0)
    assert predicted["collectives"] == measured[0]["collectives"]
    assert abs(predicted["peak"] / measured[0]["memory"]["peak"] - 1) < 0.15


def test_zero2_holds_a_flat_fp32_copy_of_its_bucket():
    from megaformer.plan.deepspeed import engine_share

    p, bucket = 1000, 400
    one, two = (engine_share("fp32", z, p, 2, 2, bucket, 1, 1) for z in (1, 2))
    assert two.state == one.state and two.transient == 4 * bucket and two.grads == 4 * 500
    assert engine_share("fp32", 2, p, 2, 2, 10**6, 1, 1).transient == 4 * p  # a bucket holds at most P
