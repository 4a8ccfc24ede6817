"""Training end to end on CPU (gloo, several processes): layouts, exact resume, faults, signals, precision.

Every run trains configs/tiny.yaml on the built-in corpus. Faults (a rank killed, a kill
during a checkpoint write, signals, an fp16 overflow) are injected from outside the
package by tests/fakes/sitecustomize.py.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from train_helpers import FAKES, TINY, common, falling, losses, megaformer, ok, train

from megaformer.train.device import kernel_thp_mode
from megaformer.train.schedule import inverse_sqrt_lr

# ---- reference runs, shared by several tests -------------------------------------------------------


@pytest.fixture(scope="session")
def tp2_run(corpus, tmp_path_factory) -> Path:
    """TP=2, 30 steps, dropout on, checkpoints every 10 steps: the uninterrupted reference."""
    run = tmp_path_factory.mktemp("tp2") / "run"
    ok(train(run, 2, common(corpus) + ["parallel.tp=2", "train.max_steps=30"]))
    return run


@pytest.fixture(scope="session")
def dp2_run(corpus, tmp_path_factory) -> Path:
    """DP=2 with ZeRO-2, 30 steps; steps 5-6 profiled (which must not change them: resumes compare with it)."""
    run = tmp_path_factory.mktemp("dp2") / "run"
    profile = ["train.profile_from=5", "train.profile_steps=2"]
    ok(train(run, 2, common(corpus) + ["train.zero_stage=2", "train.max_steps=30"] + profile))
    return run


def test_tp2_trains_with_falling_loss(tp2_run):
    curve = losses(tp2_run)
    assert sorted(curve) == list(range(1, 31))
    assert falling(curve), [round(curve[s]["loss"], 3) for s in sorted(curve)]
    for key in ("step", "loss", "lr", "grad_norm", "loss_scale", "tokens", "tokens_per_s", "mfu"):
        assert key in curve[30]
    assert all(math.isfinite(curve[s]["grad_norm"]) for s in curve)
    assert (tp2_run / "config.yaml").is_file() and (tp2_run / "tensorboard").is_dir()


def test_dp2_zero2_trains_with_falling_loss(dp2_run):
    assert falling(losses(dp2_run))
    for rank in (0, 1):  # train.profile_from=5: each rank's trace and summary of steps 5-6
        summary = json.loads((dp2_run / "profile" / f"summary-rank{rank}.json").read_text())
        assert (summary["first_step"], summary["steps"], summary["busy"]) == (5, 2, None)
        assert len(summary["top"]) == 10 and summary["wall_ms"] > 0
        assert json.loads((dp2_run / "profile" / f"trace-rank{rank}.json").read_text())["traceEvents"]


def test_tp2_dp2_trains_with_falling_loss(corpus, tmp_path):
    run = tmp_path / "run"
    ok(
        train(
            run,
            4,
            common(corpus) + ["parallel.tp=2", "train.zero_stage=2", "train.max_steps=30", "train.save_interval=0"],
        )
    )
    assert falling(losses(run))


def test_tp2_loss_curve_equals_tp1(corpus, tp2_run, tmp_path):
    """Exact-mode dropout makes TP=2 follow TP=1; here with dropout on (stronger than off)."""
    run = tmp_path / "tp1"
    ok(train(run, 1, common(corpus) + ["train.max_steps=10", "train.save_interval=0"]))
    one, two = losses(run), losses(tp2_run)
    for step in range(1, 11):
        assert abs(one[step]["loss"] - two[step]["loss"]) <= 1e-4 * abs(one[step]["loss"]), step


# ---- exact resume after faults -------------------------------------------------------------------------


def test_kill_and_resume_is_exact(corpus, tp2_run, tmp_path):
    """A rank killed at step 13, then a kill while checkpoint 20 is written: the curve equals the uninterrupted one."""
    run = tmp_path / "run"
    sets = common(corpus) + ["parallel.tp=2", "train.max_steps=30"]
    first = train(run, 2, sets, fault="kill:rank=1:step=13")
    assert first.returncode != 0
    assert (run / "checkpoints" / "step-00000010" / "meta.json").is_file()
    second = train(run, 2, sets, fault="kill_in_save:rank=0:step=20")
    assert second.returncode != 0
    assert "resumed from" in second.stdout and "step-00000010" in second.stdout
    assert not (run / "checkpoints" / "step-00000020").exists()
    assert (run / "checkpoints" / ".step-00000020.tmp").exists()  # the torn write, never loaded
    third = train(run, 2, sets)
    ok(third)
    assert "step-00000010 (step 10" in third.stdout  # fell back over the torn step 20
    assert "unfinished" in third.stdout
    resumed, reference = losses(run), losses(tp2_run)
    assert sorted(resumed) == list(range(1, 31))
    for step in range(1, 31):
        assert resumed[step]["loss"] == reference[step]["loss"], step


# ---- the learning-rate cool-down ------------------------------------------------------------------------


def test_cooldown_ramps_the_last_steps_and_a_kill_inside_it_resumes_exactly(corpus, dp2_run, tmp_path):
    """train.cooldown_fraction=0.3 of 30 steps: updates 22..30 ramp down to 0; a rank killed on the ramp resumes on it."""
    sets = [*common(corpus), "train.zero_stage=2", "train.max_steps=30", "train.cooldown_fraction=0.3"]
    sets += ["train.save_interval=11"]
    whole = tmp_path / "whole"
    proc = train(whole, 2, sets)
    ok(proc)
    assert "after update 21, the lr ramps down to 0 over the next 9 updates" in proc.stdout
    cooled, plain = losses(whole), losses(dp2_run)  # dp2_run: the same run without the cool-down
    for step in range(1, 23):  # the loss of step 22 is the last one before a ramped update
        assert cooled[step]["loss"] == plain[step]["loss"], step
    # the lr logged at a step is the next update's: updates 22..30 get 9/10 .. 1/10 of the paper's
    for step in range(1, 30):
        assert cooled[step]["lr"] == pytest.approx(plain[step]["lr"] * min((30 - step) / 10, 1), rel=1e-12), step
    assert cooled[30]["lr"] == 0
    cut = tmp_path / "cut"
    assert train(cut, 2, sets, fault="kill:rank=1:step=25").returncode != 0
    second = train(cut, 2, sets)
    ok(second)
    assert "step-00000022" in second.stdout and "ramps down" not in second.stdout  # the saved ramp, not a new one
    resumed = losses(cut)
    assert sorted(resumed) == list(range(1, 31))
    for step in range(1, 31):
        assert resumed[step]["loss"] == cooled[step]["loss"], step
        assert resumed[step]["lr"] == cooled[step]["lr"], step


def test_cooldown_of_a_time_budget_lasts_the_rest_of_the_time_at_the_rate_so_far(corpus, tmp_path):
    """train.max_minutes=0.1875 (11.25 s), cooldown_fraction 0.5: the ramp begins after 5.625 s of steps and lasts
    the steps the rest of the time gives at the recent rate.

    Each step lasts exactly 125 ms by the trainer's clock (the ``step_clock`` fault; exact in binary, so are
    the sums): measured on 2 shared cores, the rate moved 12 % between the halves and the figures with it.
    """
    run = tmp_path / "run"
    sets = [*common(corpus), "train.max_steps=100000", "train.max_minutes=0.1875", "train.cooldown_fraction=0.5"]
    proc = train(run, 2, [*sets, "train.save_interval=0"], fault="step_clock:step=125")
    ok(proc)
    began = re.search(r"after update (\d+), the lr ramps down to 0 over the next (\d+) updates", proc.stdout)
    assert began, proc.stdout[-3000:]
    start, length = int(began[1]), int(began[2])
    # 45 steps spend 5.625 s: the 46th sees it. The recent rate (budget.steps_left): the steps since the mark at
    # step 26 (the run settled at 6, marks every 10), 20 in 2.5 s (the world's seconds lag a step); the 5.625 s
    # left give 45 more. A ramp of the whole budget, or none, would be 2x off.
    assert (start, length) == (46, 45), proc.stdout[-3000:]
    curve = losses(run)
    last = max(curve)
    assert last == start + length and "train.max_minutes=0.1875 reached at step 91" in proc.stdout  # both end there
    for step in range(start, last + 1):
        paper = inverse_sqrt_lr(step + 1, 64, 100, lr_scale=2.0)  # tiny's d_model, common()'s schedule
        assert curve[step]["lr"] == pytest.approx(paper * (start + length - step) / (length + 1), rel=1e-9), step
    (saved,) = (run / "checkpoints").glob("step-*/meta.json")  # the one at the end, for a resume to go on with
    assert json.loads(saved.read_text())["run"]["engine"]["cooldown"] == [start, length]


# ---- resume at another layout -----------------------------------------------------------------------


def _resume_from(src_run: Path, step: int, dst: Path) -> None:
    (dst / "checkpoints").mkdir(parents=True)
    shutil.copytree(src_run / "checkpoints" / f"step-{step:08d}", dst / "checkpoints" / f"step-{step:08d}")


@pytest.mark.parametrize("tp", [1, 4])
def test_resume_at_other_tp(corpus, tp2_run, tmp_path, tp):
    run = tmp_path / "run"
    _resume_from(tp2_run, 10, run)
    proc = train(run, tp, common(corpus) + [f"parallel.tp={tp}", "train.max_steps=12", "train.save_interval=0"])
    ok(proc)
    assert f"layout tp=2 dp=1 -> tp={tp} dp=1" in proc.stdout
    resumed, reference = losses(run), losses(tp2_run)
    for step in (11, 12):  # the first step and the next: Adam's moments were carried, no restart spike
        assert abs(resumed[step]["loss"] - reference[step]["loss"]) <= 1e-5 * reference[step]["loss"], step
        assert abs(resumed[step]["grad_norm"] - reference[step]["grad_norm"]) <= 1e-4 * reference[step]["grad_norm"]


def test_a_tp_size_that_pads_the_vocabulary_otherwise_resumes_reshards_and_decodes_at_others(corpus, tmp_path):
    """parallel.vocab_multiple=24 pads to a multiple of 48 at tp=2, of 24 at tp=1 and 96 at tp=4 (as the
    default does at tp=3): the checkpoint kept tp=2's rows, which no other TP size could load, reshard or
    decode ("was it written with another model.* config?"). Padded rows carry nothing: the losses agree."""
    sets = common(corpus) + ["parallel.vocab_multiple=24", "train.max_steps=12"]
    ok(train(tmp_path / "tp2", 2, sets + ["parallel.tp=2"]))
    run = tmp_path / "tp1"
    _resume_from(tmp_path / "tp2", 10, run)
    ok(train(run, 1, sets + ["parallel.tp=1", "train.save_interval=0"]))
    resumed, reference = losses(run), losses(tmp_path / "tp2")
    for step in (11, 12):
        assert abs(resumed[step]["loss"] - reference[step]["loss"]) <= 1e-5 * reference[step]["loss"], step
    step10 = tmp_path / "tp2" / "checkpoints" / "step-00000010"
    ok(megaformer("reshard", "--ckpt", step10, "--out", tmp_path / "tp4" / "checkpoints", "--tp", "4"))
    ok(train(tmp_path / "tp4", 4, sets + ["parallel.tp=4", "train.save_interval=0"]))
    resumed4 = losses(tmp_path / "tp4")
    assert abs(resumed4[11]["loss"] - reference[11]["loss"]) <= 1e-5 * reference[11]["loss"]
    source = tmp_path / "in.txt"
    source.write_text("a b c\n")
    ok(megaformer("translate", "--ckpt", step10, "--input", source))


def test_resume_at_a_dp_size_that_does_not_divide_the_streams_says_the_data_is_replanned(corpus, tp2_run, tmp_path):
    """tp=2 dp=1 (one data stream) resumed at tp=1 dp=2: the rest of the epoch is planned for 2 streams."""
    run = tmp_path / "run"
    _resume_from(tp2_run, 10, run)
    proc = train(run, 2, common(corpus) + ["train.max_steps=11", "train.save_interval=0"])
    ok(proc)
    assert "layout tp=2 dp=1 -> tp=1 dp=2" in proc.stdout and "(2 data streams," in proc.stdout, proc.stdout
    assert "data re-planned: the checkpoint's data streams (1) do not divide among 2 DP ranks" in proc.stdout
    assert 0 < losses(run)[11]["loss"] < 2 * losses(tp2_run)[11]["loss"]  # other batches: only sane


def test_resume_at_smaller_dp(corpus, dp2_run, tmp_path):
    run = tmp_path / "run"
    _resume_from(dp2_run, 10, run)
    proc = train(run, 1, common(corpus) + ["train.zero_stage=2", "train.max_steps=12", "train.save_interval=0"])
    ok(proc)
    assert "layout tp=1 dp=2 -> tp=1 dp=1" in proc.stdout and "(2 data streams," in proc.stdout
    resumed, reference = losses(run), losses(dp2_run)
    for step in (11, 12):
        assert abs(resumed[step]["loss"] - reference[step]["loss"]) <= 1e-5 * reference[step]["loss"], step


def test_resume_from_a_damaged_checkpoint_is_refused(corpus, tp2_run, tmp_path):
    """train --resume STEP_DIR whose model file has the right size and the wrong bytes: one line naming it."""
    run = tmp_path / "run"
    _resume_from(tp2_run, 10, run)
    shard = run / "checkpoints" / "step-00000010" / "model-tp00-of-02.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    sets = common(corpus) + ["parallel.tp=2", "train.max_steps=12"]
    proc = train(run, 2, sets, resume=str(run / "checkpoints" / "step-00000010"))
    assert proc.returncode != 0
    assert "model-tp00-of-02.pt" in proc.stderr and "sha256" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    auto = train(run, 2, sets)  # --resume auto: the damaged step is skipped, and said
    ok(auto)
    assert "skipping" in auto.stdout and "model-tp00-of-02.pt" in auto.stdout and "from scratch" in auto.stdout


def test_resume_with_a_malformed_trainer_state_is_refused(corpus, dp2_run, tmp_path):
    """meta.json edited by hand (its run state is not hashed): one line naming the file, no traceback."""
    run = tmp_path / "run"
    _resume_from(dp2_run, 10, run)
    meta_path = run / "checkpoints" / "step-00000010" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["run"]["engine"]["cooldown"] = [3]
    meta_path.write_text(json.dumps(meta))
    proc = train(run, 2, [*common(corpus), "train.zero_stage=2", "train.max_steps=12"])
    assert proc.returncode != 0
    assert str(meta_path) in proc.stderr and "run.engine or run.trainer is malformed" in proc.stderr, proc.stderr[
        -2000:
    ]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_reshard_and_export_commands(tp2_run, tmp_path):
    from megaformer.checkpoint import check_complete, consolidate, load_consolidated

    out = tmp_path / "tp4"
    ok(megaformer("reshard", "--ckpt", tp2_run, "--out", out, "--tp", 4))
    step_dir = out / "step-00000030"
    meta = check_complete(step_dir)
    assert meta["layout"]["tp"] == 4 and len([f for f in meta["files"] if f.startswith("model-")]) == 4
    model_file = tmp_path / "model.pt"
    ok(megaformer("export", "--ckpt", tp2_run, "--out", model_file))
    exported = load_consolidated(model_file)
    resharded = consolidate(step_dir)
    assert exported.tokenizer and exported.meta["step"] == 30
    for name, tensor in exported.model.items():
        assert torch.equal(tensor, resharded.model[name]), name


# ---- signals ------------------------------------------------------------------------------------------------


def test_usr1_saves_and_requeues_once(corpus, tmp_path):
    run, log = tmp_path / "run", tmp_path / "scontrol.log"
    env = {"PATH": f"{FAKES}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "FAKE_SCONTROL_LOG": str(log)}
    # The warning reaches one rank of two: both agree to stop after the same step.
    proc = train(
        run,
        2,
        common(corpus) + ["train.max_steps=30", "train.save_interval=0"],
        fault="usr1:rank=1:step=5",
        extra_env=env,
    )
    ok(proc)
    # Ranks agree on signals in the next step's all-reduce: both stop after step 6.
    assert json.loads((run / "checkpoints" / "step-00000006" / "meta.json").read_text())["reason"] == "SIGUSR1"
    assert log.read_text().splitlines() == ["requeue 4242"]
    assert max(losses(run)) == 6


def test_sigterm_saves_without_requeue(corpus, tmp_path):
    run, log = tmp_path / "run", tmp_path / "scontrol.log"
    env = {"PATH": f"{FAKES}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4243", "FAKE_SCONTROL_LOG": str(log)}
    proc = train(
        run, 1, common(corpus) + ["train.max_steps=30", "train.save_interval=0"], fault="term:step=4", extra_env=env
    )
    assert proc.returncode == 143, proc.stdout + proc.stderr
    assert json.loads((run / "checkpoints" / "step-00000005" / "meta.json").read_text())["reason"] == "SIGTERM"
    assert not log.exists()


def test_ranks_save_together_when_their_clocks_disagree(corpus, tmp_path):
    """train.save_minutes read from each rank's clock: rank 1's runs 20x fast, and every save is still the world's.

    A rank that decided alone to save entered the save's collectives while its peer entered
    the next step's: the run hung until the process group timed out.
    """
    run = tmp_path / "run"
    sets = [*common(corpus), "train.max_steps=30", "train.save_interval=0", "train.save_minutes=0.02"]
    proc = train(run, 2, [*sets, "parallel.timeout_minutes=1"], fault="fast_clock:rank=1:step=20", timeout=300)
    ok(proc)
    saved = sorted(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*") if p.is_dir())
    assert len(saved) >= 2 and saved[-1] == 30, saved  # rank 1's clock alone makes a save due every ~0.06 s
    assert all((run / "checkpoints" / f"step-{s:08d}" / "meta.json").is_file() for s in saved)


def test_requeue_refuses_without_progress(monkeypatch, tmp_path):
    from megaformer.train.signals import requeue

    log = tmp_path / "scontrol.log"
    monkeypatch.setenv("PATH", f"{FAKES}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SCONTROL_LOG", str(log))
    said = []
    assert requeue("7", made_progress=False, log=said.append) is False
    assert "not requeueing" in said[0] and not log.exists()
    assert requeue(None, made_progress=True, log=said.append) is False
    assert "outside a SLURM job" in said[1] and not log.exists()
    assert requeue("7", made_progress=True, log=said.append) is True
    assert log.read_text() == "requeue 7\n"
    # srun repeats the warning every 5 s to every process of the step, scontrol included: a repeat that came
    # while it ran killed it (status -10), the requeue unanswered and the job ended instead of requeued.
    monkeypatch.setenv("FAKE_SCONTROL_SIGNALS", "USR1 TERM")
    assert requeue("7", made_progress=True, log=said.append) is True, said
    assert log.read_text() == "requeue 7\n" * 2


def test_sequence_parallel_trains_what_tp1_trains_and_validates_any_length(corpus, tmp_path):
    """Dropout on, lengths of any parity: SP at tp=2 follows the unsharded run that pads its lengths alike.

    Sequence parallelism pads each batch to a multiple of tp and the dropout masks are drawn at
    that shape, so the reference pads the same way (parallel.pad_to_multiple=2; the config
    refuses SP without it, tests/test_config.py). Unpadded, step 1's loss differed by 1.6e-3
    relative. Validation pads as the training loss does. At tp=1 the setting has nothing to
    split and the log says it is ignored (it said nothing).
    """
    sets = common(corpus) + ["parallel.pad_to_multiple=2", "train.max_steps=4", "train.save_interval=0"]
    sets += ["parallel.sequence_parallel=true"]
    run = train(tmp_path / "sp", 2, sets + ["parallel.tp=2", "train.eval_interval=2"])
    ok(run)
    assert "tp=2 sequence-parallel dp=1" in run.stdout
    run = train(tmp_path / "tp1", 1, sets)
    ok(run)
    assert "train: without effect in this run: parallel.sequence_parallel=true (tp=1: no TP ranks" in run.stdout
    sp, reference = losses(tmp_path / "sp"), losses(tmp_path / "tp1")
    for step in range(1, 5):  # the SP reductions sum in another order: a few ulps of fp32
        assert abs(sp[step]["loss"] - reference[step]["loss"]) <= 1e-5 * reference[step]["loss"], step
    records = [json.loads(line) for line in (tmp_path / "sp" / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in records if r["kind"] == "valid"]
    assert [r["step"] for r in valid] == [2, 4] and all(math.isfinite(r["loss"]) for r in valid)


# ---- precision -------------------------------------------------------------------------------------------


def test_bf16_trains(corpus, tmp_path):
    """And its log is megaformer's: DeepSpeed's memory reports (12 lines) and its "no GPU found" warning are left out.

    DS_ACCELERATOR, which the suite sets for every test (conftest.py), is unset here as a user's shell leaves it.
    """
    run = tmp_path / "run"
    result = train(
        run,
        1,
        common(corpus) + ["train.precision=bf16", "train.zero_stage=1", "train.max_steps=25", "train.save_interval=0"],
        extra_env={"DS_ACCELERATOR": None},
    )
    ok(result)
    assert falling(losses(run))
    said = result.stdout + result.stderr
    assert "CPU Virtual Memory" not in said and "bf16_optimizer" not in said, said[:3000]
    assert "unable to detect it" not in said, said[:3000]


@pytest.mark.skipif(kernel_thp_mode() in ("never", "unknown"), reason="no transparent huge pages")
def test_cpu_ranks_put_large_tensors_in_huge_pages_unless_told_not_to(corpus, tmp_path):
    steps = common(corpus) + ["train.max_steps=2", "train.save_interval=0"]
    default = train(tmp_path / "default", 1, steps, extra_env={"THP_MEM_ALLOC_ENABLE": None})
    ok(default)
    assert "train: CPU tensors of 2 MiB or more in transparent huge pages (THP_MEM_ALLOC_ENABLE=1" in default.stdout
    off = train(tmp_path / "off", 1, steps, extra_env={"THP_MEM_ALLOC_ENABLE": "0"})
    ok(off)
    assert "train: CPU tensors in 4 KiB pages (THP_MEM_ALLOC_ENABLE is not 1)" in off.stdout


def test_fp16_overflow_skips_and_lowers_scale(corpus, tmp_path):
    run = tmp_path / "run"
    ok(
        train(
            run,
            1,
            common(corpus)
            + [
                "train.precision=fp16",
                "train.zero_stage=1",
                "train.max_steps=25",
                "train.fp16_hysteresis=1",
                "train.save_interval=25",
            ],
            fault="overflow:step=8",
        )
    )
    curve = losses(run)
    assert curve[8]["loss"] is None  # only a skipped step in that log line: no loss to report, not Infinity
    assert falling({s: r for s, r in curve.items() if r["loss"] is not None and math.isfinite(r["loss"])})
    assert curve[7]["skipped_steps"] == 0 and curve[8]["skipped_steps"] == 1
    assert curve[8]["loss_scale"] == curve[7]["loss_scale"] / 2
    assert curve[8]["lr"] == curve[7]["lr"]  # the skipped step did not advance the schedule
    from megaformer.checkpoint import consolidate

    weights = consolidate(run / "checkpoints" / "step-00000025").model
    assert all(bool(torch.isfinite(t).all()) for t in weights.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_non_finite_loss_stops_without_saving(corpus, tmp_path, precision):
    """A NaN loss outside fp16's skipped steps: one line naming the step, non-zero exit, nothing saved after it."""
    run = tmp_path / "run"
    sets = common(corpus) + [f"train.precision={precision}", "train.zero_stage=1", "train.max_steps=25"]
    proc = train(run, 2, sets + ["parallel.tp=2"], fault="nan:step=13")
    assert proc.returncode != 0
    assert "step 13: the loss or the gradient norm is not finite" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    steps = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    assert steps == ["step-00000010"] and (run / "checkpoints" / "latest").read_text().strip() == "step-00000010"


def test_mixed_precision_needs_zero(tmp_path):
    sets = ["parallel.backend=gloo", "train.precision=bf16", "train.zero_stage=0", f"data.path={tmp_path}"]
    proc = megaformer("train", "--config", TINY, "--run-dir", tmp_path, *[a for s in sets for a in ("--set", s)])
    assert proc.returncode == 2 and "train.zero_stage=1" in proc.stderr and "Traceback" not in proc.stderr


def test_bf16_accumulation_counts_each_micro_batch_once(corpus, tmp_path):
    """bf16 ZeRO-1 over 4 micro-batches: the gradient norm is fp32's (each micro-batch counted once)."""
    norms = {}
    for precision in ("fp32", "bf16"):
        run = tmp_path / precision
        extra = [
            f"train.precision={precision}",
            "train.zero_stage=1",
            "train.tokens_per_step=2048",
            "train.max_steps=1",
        ]
        ok(train(run, 1, common(corpus) + extra))
        norms[precision] = losses(run)[1]["grad_norm"]
    assert abs(norms["bf16"] - norms["fp32"]) <= 0.02 * norms["fp32"], norms


def test_start_up_says_a_warning_once_and_the_mfu_peak(corpus, tmp_path):
    """Samples left out by data.max_len are said once per split, as ``warning: ...``.

    Each rank said it, with Python's ``file:line: UserWarning`` and the source line under it.
    """
    run = train(tmp_path / "run", 2, common(corpus) + ["data.max_len=12", "train.max_steps=1", "train.save_interval=0"])
    ok(run)
    said = [line for line in (run.stdout + run.stderr).splitlines() if "longer than max_len=12" in line]
    assert len(said) == 1 and said[0].startswith("warning: ") and "split train" in said[0], said
    assert "UserWarning" not in run.stderr and "warnings.warn" not in run.stderr
    # MFU's denominator is said, with where it comes from (train.peak_tflops=0.1 per rank here)
    assert "train: MFU against 0.2 TFLOP/s, the peak of 2 ranks (train.peak_tflops)" in run.stdout
