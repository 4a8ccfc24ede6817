"""The checkpointer on its own: registered states saved by place and loaded back, its save schedule, and the
accessors of meta.json's schema (:mod:`megaformer.checkpoint.meta`). Training end to end is in test_train.py."""

import json

import pytest
import torch

from megaformer.checkpoint import meta as schema
from megaformer.config import TrainConfig
from megaformer.errors import CheckpointError
from megaformer.parallel import ParallelContext
from megaformer.train.checkpointer import RANK, REPLICA, RUN, SHARD, Checkpointer, TorchRNG
from megaformer.train.signals import REQUEUE, TERMINATE
from megaformer.train.step import Outcome


class Engine:
    """A sharded component: its tensors go to the model file, its counters to meta.json's run."""

    def __init__(self, model: torch.nn.Module, steps: int = 0) -> None:
        self.model, self.steps = model, steps

    def state_dict(self) -> dict:
        params = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        moments = {key: {n: torch.full_like(p, 0.5) for n, p in params.items()} for key in ("exp_avg", "exp_avg_sq")}
        return {"tensors": {"param": params, **moments}, "counters": {"global_steps": self.steps}}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(state["tensors"]["param"][n])
        self.steps = state["counters"]["global_steps"]


class Counter:
    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class Feed(Counter):
    """A replica component: loaded from every old DP rank's state and its own place's."""

    def state_dict(self) -> dict:
        return {"streams": 1, "value": self.value}

    def load_replicas(self, dp_ranks: list[dict], same_rank: dict | None) -> None:
        self.value = same_rank["value"] + 100 * len(dp_ranks)


def _checkpointer(root, engine, trainer, feed, clock=lambda: 0.0, **train) -> Checkpointer:
    t = TrainConfig(keep_last=0, **train)
    checkpointer = Checkpointer(
        ParallelContext.single(),
        root,
        t,
        None,
        lambda: {"tokens": trainer.value, "vocab_size": 8, "config": {}},
        slurm_job="77",
        log=lambda line: None,
        clock=clock,
    )
    checkpointer.register("engine", engine, SHARD)
    checkpointer.register("trainer", trainer, RUN)
    checkpointer.register(schema.FEED, feed, REPLICA)
    checkpointer.register("torch_rng", TorchRNG(), RANK)
    return checkpointer


def test_registered_states_are_saved_by_place_and_loaded_back(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    saver = _checkpointer(tmp_path, Engine(model, steps=12), Counter(5), Feed(9))
    rng = torch.get_rng_state()
    step_dir = saver.save(12, "schedule")

    meta = json.loads((step_dir / "meta.json").read_text())
    assert list(meta)[:6] == ["tokens", "vocab_size", "config", "reason", "slurm_job", "time"]  # as before
    assert meta["run"] == {"engine": {"global_steps": 12}, "trainer": {"value": 5}}
    assert meta["replicas"] == [{"feed": {"streams": 1, "value": 9}}] and meta["reason"] == "schedule"
    assert schema.saved_streams(meta) == 1 and schema.slurm_job_of(meta) == "77" and schema.step_of(meta) == 12

    fresh = torch.nn.Linear(3, 2)
    engine, trainer, feed = Engine(fresh), Counter(), Feed()
    torch.manual_seed(1)
    loaded = _checkpointer(tmp_path, engine, trainer, feed).load(step_dir, fresh)
    assert loaded["step"] == 12 and engine.steps == 12 and trainer.value == 5 and feed.value == 109
    assert torch.equal(fresh.weight, model.weight) and torch.equal(torch.get_rng_state(), rng)


def test_a_malformed_run_state_is_one_line(tmp_path):
    model = torch.nn.Linear(3, 2)
    step_dir = _checkpointer(tmp_path, Engine(model), Counter(), Feed()).save(3, "schedule")
    broken = _checkpointer(tmp_path, Engine(model), Counter(), Feed())
    broken.register("extra", Counter(), RUN)  # a state this checkpoint does not hold
    with pytest.raises(CheckpointError, match=r"run\.engine or run\.trainer or run\.extra is malformed"):
        broken.load(step_dir, model)
    with pytest.raises(ValueError, match="one component holds the model file's tensors"):
        broken.register("second", Engine(model), SHARD)


def test_the_schedule_says_why_a_step_is_saved():
    checkpointer = _checkpointer(None, None, Counter(), Feed(), save_interval=10, max_steps=100)
    reason = checkpointer.reason
    assert reason(Outcome(7), best=False) is None
    assert reason(Outcome(7), best=True) == "best"
    assert reason(Outcome(10), best=True) == "schedule"  # saved on schedule, named best too
    assert reason(Outcome(7, save_due=True), best=False) == "schedule"  # train.save_minutes
    assert reason(Outcome(100, final=True), best=False) == "schedule"
    assert reason(Outcome(7, end="time limit"), best=False) == "time limit"
    assert reason(Outcome(7, end="cool-down"), best=False) == "cool-down"
    assert reason(Outcome(7, signal=REQUEUE, end="time limit"), best=False) == "SIGUSR1"
    assert reason(Outcome(7, signal=TERMINATE, stopped_by="SIGINT"), best=False) == "SIGINT"
    assert Outcome(7, end="cool-down").last and Outcome(100, final=True).last
    assert not Outcome(100, signal=TERMINATE, final=True).last  # a signal's save is not validated first


def test_save_minutes_count_from_the_last_save_by_the_given_clock():
    now = [0.0]
    checkpointer = _checkpointer(None, None, Counter(), Feed(), clock=lambda: now[0], save_minutes=2)
    now[0] = 119.0
    assert not checkpointer.minutes_passed()
    now[0] = 120.0
    assert checkpointer.minutes_passed()
    checkpointer.restart_clock()
    assert not checkpointer.minutes_passed()
    assert not _checkpointer(None, None, Counter(), Feed(), clock=lambda: 1e9).minutes_passed()  # save_minutes=0


def test_meta_accessors_read_replicas_by_place(tmp_path):
    # Two DP ranks of two TP ranks each: replicas in rank order (TP innermost).
    meta = {
        "step": 4,
        "layout": {"tp": 2, "dp": 2, "pp": 2, "stages": [3, 3]},
        "rank_layout": {"tp": 2, "dp": 2},
        "replicas": [{"feed": {"streams": 2, "rank": r}} for r in range(4)],
    }
    assert [s["rank"] for s in schema.replica_states(meta, "feed")] == [0, 2]  # the first TP rank of each DP rank
    assert schema.replica_state_at(meta, "feed", 1, 1)["rank"] == 3
    assert schema.replica_state_at(meta, "feed", 2, 0) is None  # no such old rank
    assert schema.saved_streams(meta) == 2 and schema.stages_of(meta) == [3, 3]
    for bad in ([], [{}], [{"feed": {"streams": "2"}}], [{"feed": {"streams": True}}], [{"feed": {"streams": 0}}]):
        assert schema.saved_streams({"replicas": bad}) is None
    with pytest.raises(CheckpointError, match=r"replicas\[0\]\.feed\.streams is not a count"):
        schema.require_streams(tmp_path, {"replicas": [{}]})
    (tmp_path / "meta.json").write_text("[1]")
    with pytest.raises(ValueError, match="not a JSON object"):
        schema.read_meta(tmp_path)
