"""The tokens of an optimizer step stay at the config's value at every world size (no processes)."""

import json

import pytest

from megaformer import cli
from megaformer.data.batching import StepPlan, plan_step
from megaformer.errors import ConfigError

BIG = "configs/transformer_big.yaml"


@pytest.mark.parametrize("streams", [1, 2, 3, 4, 6, 8, 16, 24, 32, 48, 64])
@pytest.mark.parametrize("tokens_per_step", [2048, 25000, 100000, 400000])
@pytest.mark.parametrize("max_tokens", [1024, 4096, 8192])
def test_step_within_ten_percent_or_refused(streams, tokens_per_step, max_tokens):
    min_tokens = 257  # data.max_len 256 + eos
    try:
        plan = plan_step(tokens_per_step, streams, max_tokens, min_tokens)
    except ConfigError as err:
        # Refused only when a stream's share cannot hold one micro-batch of the longest sample.
        assert tokens_per_step / streams < min_tokens * 1.1
        assert "train.tokens_per_step" in str(err) and str(streams * min_tokens) in str(err)
        return
    # Counted independently of the plan's own property.
    total = streams * plan.micro_batches_per_stream * plan.max_tokens_per_micro_batch
    assert abs(total - tokens_per_step) <= 0.1 * tokens_per_step
    assert plan.tokens_per_step == total
    assert min_tokens <= plan.max_tokens_per_micro_batch <= max_tokens  # lowered, never raised


def test_old_rule_grew_the_step_the_plan_does_not():
    # transformer_big at TP=1 on 32 GPUs: the old max(1, round(...)) rule gave 32 x 4096 = 131,072 tokens.
    old = max(1, round(25000 / (32 * 4096))) * 32 * 4096
    assert old > 5 * 25000
    plan = plan_step(25000, 32, 4096, 257)
    assert plan == StepPlan(32, 1, 781)
    assert plan.tokens_per_step == 24992


def test_configured_micro_batch_kept_when_close():
    # 25000 / (8 x 4096) rounds to 1: 32,768 tokens is 31 % over, so the micro-batch shrinks.
    assert plan_step(25000, 8, 4096) == StepPlan(8, 1, 3125)
    # 25000 over 1 stream of 4096: 6 x 4096 = 24,576 is within 2 %, kept as configured.
    assert plan_step(25000, 1, 4096) == StepPlan(1, 6, 4096)
    # tiny (2048 tokens, 1024 per micro-batch) keeps its two micro-batches.
    assert plan_step(2048, 1, 1024) == StepPlan(1, 2, 1024)


def test_micro_batches_per_rank():
    plan = plan_step(25000, 4, 4096)  # 6250 per stream: 2 micro-batches of 3125
    assert plan == StepPlan(4, 2, 3125)
    assert plan.micro_batches_per_rank(dp=2) == 4 and plan.micro_batches_per_rank(dp=4) == 2


def test_bad_values_refused():
    with pytest.raises(ConfigError, match="at least 1"):
        plan_step(0, 1, 4096)


def test_info_reports_the_step(capsys):
    assert cli.main(["info", "--config", BIG, "--json", "--set", "parallel.tp=1", "--set", "parallel.dp=32"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["micro_batches_per_step"] == 1
    assert info["max_tokens_per_micro_batch"] == 781
    assert info["tokens_per_step"] == 32 * 781


def test_info_refuses_a_step_that_cannot_fit(capsys):
    code = cli.main(
        ["info", "--config", BIG, "--json", "--set", "parallel.tp=1", "--set", "parallel.dp=128"]
        + ["--set", "train.tokens_per_step=25000"]
    )
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.tokens_per_step" in err[0]
