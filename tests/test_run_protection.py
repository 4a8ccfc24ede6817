"""Runs that protect themselves: one writer per run directory, data checked as it streams, resumes that say what they do.

Each bad case ends in one line naming the file or setting and a non-zero exit (or, for a
resume with nothing to do, one line and exit 0), and nothing that should survive is lost.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from train_helpers import FAKES, records

from megaformer import cli
from megaformer.checkpoint import check_complete, find_latest, list_checkpoints, sha256_of
from megaformer.data.manifest import read_manifest, write_manifest
from megaformer.data.shards import open_prepared, verify_split
from megaformer.data.stream import TokenBatchStream
from megaformer.errors import CheckpointError, ConfigError, DataError
from megaformer.train.run_lock import LOCK_NAME, Holder, RunLock

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
QUICK = [
    "data.max_tokens=512",
    "data.num_workers=0",
    "train.tokens_per_step=512",
    "train.log_interval=5",
    "train.eval_interval=0",
    "train.save_interval=5",
    "train.keep_last=10",
]


def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_JOB_ID", "SLURM_PROCID"):
        env.pop(name, None)
    return env


def _train_argv(run_dir: Path, data: Path, *sets: str, extra: tuple[str, ...] = ()) -> list[str]:
    argv = [sys.executable, "-m", "megaformer.cli", "train", "--config", str(TINY), "--run-dir", str(run_dir)]
    for s in [f"data.path={data}", "parallel.backend=gloo", *QUICK, *sets]:  # CPU tensors, also where CUDA is
        argv += ["--set", s]
    return argv + list(extra)


def _train(run_dir: Path, data: Path, *sets: str, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    argv = _train_argv(run_dir, data, *sets, extra=extra)
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=600)


def _one_line_error(proc: subprocess.CompletedProcess, fragment: str) -> str:
    assert proc.returncode not in (0, None), proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines and fragment in lines[-1], proc.stderr
    return lines[-1]


def _prepare(out: Path, pairs: int = 600, seed: int = 1234, shard_size: int = 200) -> Path:
    argv = ["prepare", "--synthetic", str(pairs), "--out", str(out), "--shard-size", str(shard_size)]
    assert cli.main([*argv, "--seed", str(seed), "--quiet"]) == 0
    return out


@pytest.fixture
def data(tmp_path) -> Path:
    return _prepare(tmp_path / "data")


@pytest.fixture(scope="module")
def shared_data(tmp_path_factory) -> Path:
    return _prepare(tmp_path_factory.mktemp("shared") / "data")


def _stream_all(path: Path, epochs: int = 1) -> int:
    stream = TokenBatchStream(path, "train", dp_rank=0, dp_size=1, max_tokens=512, repeat=False)
    return sum(len(b) for _ in range(epochs) for b in stream)


# ---- one writer per run directory ---------------------------------------------------------------

HOLD = """
import sys, time
from pathlib import Path
from megaformer.train.run_lock import RunLock
lock = RunLock(Path(sys.argv[1]), sys.argv[2] or None).acquire()
print("held", flush=True)
time.sleep(float(sys.argv[3]))
lock.release()
"""


def _holder(run_dir: Path, job: str = "", seconds: float = 30.0) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir), job, str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=_env(),
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_held_run_dir_is_refused_naming_the_holder(tmp_path):
    holder = _holder(tmp_path / "run")
    try:
        with pytest.raises(ConfigError, match=rf"pid {holder.pid} on .*another --run-dir"):
            RunLock(tmp_path / "run", None).acquire(requeue_wait_s=0)
    finally:
        holder.kill()
        holder.wait()
    # The kernel released the killed holder's lock; the next writer takes it over and says so.
    said = []
    lock = RunLock(tmp_path / "run", None, log=said.append).acquire()
    assert any(f"pid {holder.pid}" in line and "no longer running" in line for line in said), said
    lock.release()
    assert (tmp_path / "run" / LOCK_NAME).read_text() == ""  # released: nobody holds it


def test_a_requeued_slurm_job_waits_for_its_earlier_self_then_takes_over(tmp_path):
    holder = _holder(tmp_path / "run", job="4242", seconds=1.5)
    began = time.monotonic()
    with pytest.raises(ConfigError, match="SLURM job 4242"):  # another job: refused at once
        RunLock(tmp_path / "run", "777").acquire(requeue_wait_s=10)
    assert time.monotonic() - began < 1.4
    lock = RunLock(tmp_path / "run", "4242").acquire(requeue_wait_s=10)  # the same job: waits, then holds
    assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["slurm_job_id"] == "4242"
    lock.release()
    holder.wait(timeout=10)


def test_check_free_refuses_another_holder_and_takes_nothing(tmp_path):
    """`train --check` (a SLURM job's batch shell, before srun): acquire's verdict, without the lock."""
    run = tmp_path / "run"
    RunLock(run, None).check_free()  # nothing there: free, and nothing made
    assert not run.exists()
    holder = _holder(run, job="4242")
    try:
        with pytest.raises(ConfigError, match=rf"pid {holder.pid} on .*SLURM job 4242.*another --run-dir"):
            RunLock(run, "777").check_free()
        with pytest.raises(ConfigError, match=rf"pid {holder.pid}"):
            RunLock(run, None).check_free()
        RunLock(run, "4242").check_free()  # a requeued job's earlier attempt: its ranks take the lock over
        record = (run / LOCK_NAME).read_text()
    finally:
        holder.kill()
        holder.wait()
    assert (run / LOCK_NAME).read_text() == record  # the checks wrote nothing
    RunLock(run, "777").check_free()  # the record of a holder that is gone: the flock is free
    with _lock_held_by(RELEASING, tmp_path / "other", b"cleared"):  # a record cleared: changing hands, not held
        RunLock(tmp_path / "other", "777").check_free()


RELEASING = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
print("cleared", flush=True)
time.sleep(0.5)
fcntl.flock(fd, fcntl.LOCK_UN)
"""


@contextmanager
def _lock_held_by(script: str, run_dir: Path, says: bytes) -> Iterator[None]:
    """``script`` locks ``run_dir``'s lock file in another process; inside, it has printed ``says``."""
    run_dir.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", script, str(run_dir / LOCK_NAME)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == says
        yield
    finally:
        proc.wait(timeout=10)


def test_a_lock_changing_hands_is_waited_for_not_refused(tmp_path):
    """A holder between clearing its record and unlocking (or between locking and writing it): not a refusal."""
    with _lock_held_by(RELEASING, tmp_path / "run", b"cleared"):
        RunLock(tmp_path / "run", "4242").acquire(requeue_wait_s=0).release()


HELD_THEN_RELEASING = """
import fcntl, json, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, json.dumps({"host": "elsewhere", "pid": 1, "slurm_job_id": "4242", "started": time.time()}).encode())
print("held", flush=True)
time.sleep(1.5)
os.ftruncate(fd, 0)  # releasing: the record cleared, the lock still held for longer than a poll
time.sleep(0.8)
fcntl.flock(fd, fcntl.LOCK_UN)
"""


def test_a_requeued_job_whose_earlier_self_releases_late_in_the_wait_takes_over(tmp_path):
    """The record cleared 1.5 s into the wait, the lock held 0.8 s more: still the hand-over, not another process."""
    with _lock_held_by(HELD_THEN_RELEASING, tmp_path / "run", b"held"):
        RunLock(tmp_path / "run", "4242").acquire(requeue_wait_s=10).release()


def test_without_flock_a_dead_holder_on_this_host_is_taken_over_and_a_live_one_refused(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    run = tmp_path / "run"
    run.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    me = Holder.this_process(None)
    (run / LOCK_NAME).write_text(json.dumps({**me.__dict__, "pid": int(dead.stdout)}))
    said = []
    RunLock(run, None, log=said.append).acquire().release()
    assert any("no longer running" in line for line in said), said
    alive = _holder(tmp_path / "elsewhere", seconds=30)  # a live process, recorded as the holder
    try:
        (run / LOCK_NAME).write_text(json.dumps({**me.__dict__, "pid": alive.pid}))
        with pytest.raises(ConfigError, match=f"pid {alive.pid}"):
            RunLock(run, None).acquire()
    finally:
        alive.kill()
        alive.wait()


def test_two_trainings_on_one_run_dir_the_second_is_refused_and_the_first_keeps_its_checkpoints(data, tmp_path):
    run = tmp_path / "run"
    argv = _train_argv(run, data, "train.max_steps=30", "train.seed=11")
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=_env())
    try:
        deadline = time.monotonic() + 120
        while not ((run / LOCK_NAME).is_file() and (run / LOCK_NAME).read_text()):
            assert time.monotonic() < deadline and first.poll() is None, "the first training did not start"
            time.sleep(0.2)
        began = time.monotonic()
        second = _train(run, data, "train.max_steps=30", "train.seed=99")
        assert time.monotonic() - began < 10  # refused before any work: Python's start-up and one config read
        line = _one_line_error(second, f"--run-dir {run}: another training writes there (pid {first.pid}")
        assert "another --run-dir" in line
        check = _train(run, data, "train.max_steps=30", extra=("--check",))  # the same verdict, the lock not taken
        _one_line_error(check, f"--run-dir {run}: another training writes there (pid {first.pid}")
        fresh = _train(tmp_path / "fresh", data, extra=("--check",))
        assert fresh.returncode == 0 and "train: checked: 1 process (tp=1 dp=1 pp=1)" in fresh.stdout, fresh.stderr
        assert not (tmp_path / "fresh").exists()  # a check writes nothing
        out, err = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, out[-2000:] + err[-2000:]
    steps = list_checkpoints(run / "checkpoints")
    assert [p.name for p in steps] == [f"step-{n:08d}" for n in (30, 25, 20, 15, 10, 5)]
    for step_dir in steps:
        meta = check_complete(step_dir, verify=True)
        assert meta["config"]["train"]["seed"] == 11  # all the first run's
    logged = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == sorted(set(logged))  # one writer: no interleaved steps


# ---- data checked while training ----------------------------------------------------------------


def _rewrite_manifest(path: Path, change) -> None:
    manifest = read_manifest(path)
    change(manifest)
    write_manifest(Path(path), manifest)


def test_a_replaced_lengths_index_is_refused_by_train_inspect_and_the_stream(data, tmp_path):
    index = data / "train.lengths.npy"
    lengths = np.load(index)
    np.save(index, lengths[::-1].copy())  # same shape, same totals, other lengths
    with pytest.raises(DataError, match=r"train\.lengths\.npy: its bytes do not match the sha256"):
        open_prepared(data, "train")
    proc = subprocess.run(
        [sys.executable, "-m", "megaformer.cli", "inspect", str(data)], capture_output=True, text=True, env=_env()
    )
    _one_line_error(proc, "train.lengths.npy: its bytes do not match the sha256")
    _one_line_error(_train(tmp_path / "run", data, "train.max_steps=2"), "train.lengths.npy: its bytes do not match")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_lengths_index_that_does_not_fit_its_shards_stops_the_stream(data):
    index = data / "train.lengths.npy"
    lengths = np.load(index)
    lengths[[0, 1]] = lengths[[1, 0]]  # the index was re-made for another order of the shards
    np.save(index, lengths)
    _rewrite_manifest(data, lambda m: m["splits"]["train"]["lengths"].update(sha256=sha256_of(index)))
    if (lengths[0] == lengths[1]).all():
        pytest.skip("the first two samples have equal lengths")
    with pytest.raises(DataError, match="the lengths index says"):
        _stream_all(data)
    with pytest.raises(DataError, match="the lengths index of"):
        verify_split(open_prepared(data, "train"))


def test_a_damaged_shard_stops_the_stream_naming_it_and_verification_off_reads_it(data):
    shard = data / "train-000001.tar"
    raw = bytearray(shard.read_bytes())
    at = raw.rindex(b"\x93NUMPY") + 128 + 1  # inside the last sample's payload
    raw[at] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"train-000001\.tar: its bytes do not match the sha256"):
        _stream_all(data)
    with pytest.raises(DataError, match="train-000001.tar"):
        verify_split(open_prepared(data, "train"))


def test_token_ids_outside_the_vocabulary_are_refused(data):
    from megaformer.data.shards import ShardWriter, read_shard, token_dtype

    manifest = read_manifest(data)
    vocab = manifest["tokenizer"]["vocab_size"]
    split = open_prepared(data, "train")
    samples = [(src.tolist(), tgt.tolist()) for _, src, tgt in read_shard(split.urls[0])]
    samples[3] = (samples[3][0][:-1] + [vocab + 5], samples[3][1])  # an id the embedding has no row for
    writer = ShardWriter(data / "rewritten", "train", len(samples), token_dtype(vocab))
    (data / "rewritten").mkdir()
    for src, tgt in samples:
        writer.write(src, tgt)
    entry = writer.close()
    os.replace(data / "rewritten" / "train-000000.tar", data / "train-000000.tar")
    _rewrite_manifest(data, lambda m: m["splits"]["train"]["shards"][0].update(sha256=entry["shards"][0]["sha256"]))
    with pytest.raises(DataError, match=rf"train-000000\.tar \(source side\): token id {vocab + 5} is outside"):
        _stream_all(data)
    with pytest.raises(DataError, match="outside the vocabulary"):
        verify_split(open_prepared(data, "train"))


def test_verification_changes_nothing_in_the_batches(shared_data):
    def batches(verify: bool) -> list:
        stream = TokenBatchStream(
            shared_data, "train", dp_rank=0, dp_size=1, max_tokens=512, repeat=False, verify=verify
        )
        return [b.src.tolist() for b in stream]

    assert batches(True) == batches(False)


# ---- resumes that say what they do --------------------------------------------------------------


@pytest.fixture(scope="module")
def finished(shared_data, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("finished") / "run"
    proc = _train(run, shared_data, "train.max_steps=10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def _copy_run(run: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(run, to)
    (to / LOCK_NAME).unlink(missing_ok=True)
    return to


def test_a_resume_with_nothing_left_says_which_limit_and_option(finished, shared_data, tmp_path):
    run = _copy_run(finished, tmp_path / "run")
    proc = _train(run, shared_data, "train.max_steps=10")
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stdout.splitlines() if "nothing to train" in line]
    assert len(said) == 1 and "train.max_steps=10: raise train.max_steps" in said[0], proc.stdout
    assert [p.name for p in list_checkpoints(run / "checkpoints")][0] == "step-00000010"


def test_a_resume_with_nothing_left_does_not_validate_again(shared_data, tmp_path):
    """A finished run validated its last step before saving it: resumed, it says so and validates nothing."""
    run = tmp_path / "run"
    sets = ("train.max_steps=6", "train.eval_interval=4")
    first = _train(run, shared_data, *sets)
    assert first.returncode == 0, first.stderr[-3000:]
    assert [line.split()[1] for line in first.stdout.splitlines() if line.startswith("valid ")] == ["4", "6"]
    again = _train(run, shared_data, *sets)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing to train" in again.stdout
    assert not [line for line in again.stdout.splitlines() if line.startswith("valid ")], again.stdout
    assert [r["step"] for r in records(run, "valid")] == [4, 6]


def test_a_signal_save_at_the_last_step_is_validated_once_on_resume(shared_data, tmp_path):
    """SIGTERM saves the last step without validating it; the resume validates and saves it, the next does nothing.

    Without BLEU no validation is a best one: the resume's was saved only when it was.
    """
    run, sets = tmp_path / "run", ("train.max_steps=6", "train.eval_interval=4", "train.eval_bleu_sentences=0")
    env = {**_env(), "PYTHONPATH": f"{FAKES}{os.pathsep}{ROOT}", "MEGAFORMER_TEST_FAULT": "term:step=5"}
    first = subprocess.run(_train_argv(run, shared_data, *sets), capture_output=True, text=True, cwd=ROOT, env=env)
    assert first.returncode == 143 and "checkpoint: saved" in first.stdout, first.stdout[-2000:] + first.stderr[-2000:]
    for _ in range(2):
        again = _train(run, shared_data, *sets)
        assert again.returncode == 0 and "nothing to train" in again.stdout, again.stderr[-3000:]
    assert [r["step"] for r in records(run, "valid")] == [4, 6]


@pytest.mark.parametrize(
    "changed, named",
    [
        ("model.norm=pre", "model.norm='post' (this run: 'pre')"),  # other parameter names (a recipe's new default)
        ("model.d_model=128", "model.d_model=64 (this run: 128)"),  # other shapes: a traceback in the load before
        ("model.num_heads=2", "model.num_heads=4 (this run: 2)"),  # the same shapes: loaded as another model before
    ],
)
def test_a_resume_with_other_model_settings_names_them(finished, shared_data, tmp_path, changed, named):
    """A run directory resumed with another architecture is refused in one line naming the setting, nothing written."""
    run = _copy_run(finished, tmp_path / "run")
    before = (run / "config.yaml").read_text() if (run / "config.yaml").is_file() else None
    line = _one_line_error(_train(run, shared_data, "train.max_steps=12", changed), "does not match the model")
    assert "step-00000010" in line and named in line and "--run-dir" in line, line
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step-00000010", "step-00000005"]
    assert ((run / "config.yaml").read_text() if before is not None else None) == before


def test_a_resume_may_change_dropout_and_names_every_change(finished, shared_data, tmp_path):
    """Dropout changes how the model trains, not what its weights compute: a resume takes it.

    Every other setting changed is named too: a 5x lr, twice the step's tokens, another seed
    applied without a word before (only dropout, precision and a few others were listed).
    """
    run = _copy_run(finished, tmp_path / "run")
    changes = ("model.dropout=0.3", "train.lr_scale=5", "train.tokens_per_step=1024", "train.seed=7")
    proc = _train(run, shared_data, "train.max_steps=11", *changes)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "step-00000010" in proc.stdout, proc.stdout[-3000:]
    said = [line for line in proc.stdout.splitlines() if "changed since the checkpoint: " in line]
    assert len(said) == 1, proc.stdout[-3000:]
    for change in ("model.dropout 0.1 -> 0.3", "train.lr_scale 0.5 -> 5.0", "train.seed 1 -> 7"):
        assert change in said[0], said[0]
    assert "train.tokens_per_step 512 -> 1024" in said[0] and "train.max_steps 10 -> 11" in said[0]
    assert "parallel.tp" not in said[0] and "model.d_model" not in said[0], said[0]
    assert [p.name for p in list_checkpoints(run / "checkpoints")][0] == "step-00000011"


def test_resume_none_into_a_run_dir_with_checkpoints_is_refused(finished, shared_data, tmp_path):
    """`--resume none` where an earlier run saved: its checkpoints would mix with the new run's (pruning, auto resume)."""
    run = _copy_run(finished, tmp_path / "run")
    metrics = (run / "metrics.jsonl").read_text()
    line = _one_line_error(
        _train(run, shared_data, "train.max_steps=3", extra=("--resume", "none")), "holds an earlier run's checkpoints"
    )
    assert "step-00000010" in line and "--resume auto" in line and "--run-dir" in line, line
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step-00000010", "step-00000005"]
    assert (run / "metrics.jsonl").read_text() == metrics


def test_a_requeued_job_started_with_resume_none_continues_what_it_saved(shared_data, tmp_path):
    """`sbatch ... --resume none`, warned and requeued by its own trainer: the second attempt (SLURM_RESTART_COUNT=1)
    was refused as if the checkpoints were another run's, and the job ended FAILED. Only the job's own saves
    (meta.json's slurm_job) are continued: another job's restart is refused as before."""
    run = tmp_path / "run"

    def attempt(job: str, restart: str, steps: int) -> subprocess.CompletedProcess:
        argv = _train_argv(run, shared_data, f"train.max_steps={steps}", extra=("--resume", "none"))
        env = {**_env(), "SLURM_JOB_ID": job, "SLURM_RESTART_COUNT": restart}
        return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)

    first = attempt("77", "0", 3)
    assert first.returncode == 0, first.stderr[-3000:]
    _one_line_error(attempt("78", "1", 4), "holds an earlier run's checkpoints (newest step-00000003)")
    again = attempt("77", "1", 4)
    assert again.returncode == 0, again.stderr[-3000:]
    said = [line for line in again.stdout.splitlines() if "--resume none is not used" in line]
    assert len(said) == 1 and "restart 1 of SLURM job 77" in said[0] and "step-00000003" in said[0], again.stdout
    assert f"resumed from {run / 'checkpoints' / 'step-00000003'} (step 3" in again.stdout, again.stdout[-3000:]


def test_a_checkpoint_given_starts_a_run_and_a_restart_continues_the_runs_own(finished, shared_data, tmp_path):
    """`--resume PATH` starts a run; the same command again (a requeued SLURM job) continues that run's own newest
    checkpoint, saying so, as fairseq's --restore-file does. It resumed PATH again before: the second start
    trained from step 5 into a directory holding step 6, mixing the two (average took steps of both).
    A model file as --resume is refused before any process starts (a run directory was left with a lock)."""
    resume = str(_copy_run(finished, tmp_path / "other") / "checkpoints" / "step-00000005")
    run = tmp_path / "run"
    first = _train(run, shared_data, "train.max_steps=6", extra=("--resume", resume))
    assert first.returncode == 0 and f"resumed from {resume} (step 5" in first.stdout, first.stdout[-3000:]
    check = _train(run, shared_data, "train.max_steps=7", extra=("--resume", resume, "--check"))
    assert check.returncode == 0 and "(resume auto): nothing started" in check.stdout, check.stdout + check.stderr
    assert "is not used" not in check.stdout  # the batch shell's check: the ranks say it once when they run
    again = _train(run, shared_data, "train.max_steps=7", extra=("--resume", resume))
    assert again.returncode == 0, again.stderr[-3000:]
    said = [line for line in again.stdout.splitlines() if f"--resume {resume} is not used" in line]
    assert len(said) == 1 and "own checkpoints (newest step-00000006), which it continues" in said[0], again.stdout
    assert f"resumed from {run / 'checkpoints' / 'step-00000006'} (step 6" in again.stdout, again.stdout[-3000:]
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step-00000007", "step-00000006"]
    model = tmp_path / "model.pt"
    model.write_bytes(b"a model file")
    line = _one_line_error(_train(tmp_path / "new", shared_data, extra=("--resume", str(model))), "holds no training")
    assert "is a model file or export" in line and not (tmp_path / "new").exists(), line


def test_resuming_on_data_of_another_tokenizer_is_refused_unless_asked_for(finished, tmp_path):
    other = _prepare(tmp_path / "other", seed=99)  # the same sizes, another BPE model
    assert sha256_of(other / "spm.model") != sha256_of(finished / "checkpoints" / "step-00000010" / "tokenizer.model")
    run = _copy_run(finished, tmp_path / "run")
    proc = _train(run, other, "train.max_steps=12")
    _one_line_error(proc, "trained with another tokenizer than the data's")
    assert "--other-tokenizer" in proc.stderr
    assert [p.name for p in list_checkpoints(run / "checkpoints")][0] == "step-00000010"
    proc = _train(run, other, "train.max_steps=12", extra=("--other-tokenizer",))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--other-tokenizer: resuming" in proc.stdout


def test_resume_auto_never_trusts_a_directory_name_alone(finished, tmp_path):
    import shutil

    run = _copy_run(finished, tmp_path / "run")
    root = run / "checkpoints"
    shutil.copytree(root / "step-00000005", root / "step-99999999")  # a step-5 checkpoint under a big name
    said = []
    assert find_latest(run, log=said.append) == root / "step-00000010"
    assert any("step-99999999: its name says step 99999999, its meta.json step 5" in line for line in said), said
    with pytest.raises(CheckpointError, match="its name says step 99999999"):
        check_complete(root / "step-99999999")


def test_metrics_that_cannot_be_written_are_refused_before_training(shared_data, tmp_path):
    run = tmp_path / "run"
    (run / "metrics.jsonl").mkdir(parents=True)
    _one_line_error(_train(run, shared_data, "train.max_steps=2"), "metrics.jsonl: cannot be written")


def test_a_peer_that_never_joins_is_one_line_naming_the_rendezvous(shared_data, tmp_path):
    from launcher.local import reserve_port

    held = reserve_port()  # held until rank 0's store listens on it, as the launcher does (a chosen port was taken)
    try:
        port = str(held.getsockname()[1])
        env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": "0", "WORLD_SIZE": "2"}
        argv = _train_argv(tmp_path / "run", shared_data, "parallel.timeout_minutes=0.05")
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    finally:
        held.close()
    line = _one_line_error(proc, "rank 0 of 2: the ranks did not all meet at env://")
    assert "1/2 clients joined" in line and "parallel.timeout_minutes" in line


def test_sigterm_ends_a_rank_waiting_for_its_peers_at_once(shared_data, tmp_path):
    """A rank whose peer failed before the rendezvous (srun then TERMs the rest) held TERM until SIGKILL:
    under SLURM the job ended 137, KillWait seconds later, instead of with the failure's status."""
    from launcher.local import reserve_port

    held = reserve_port()
    port = held.getsockname()[1]
    env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "2"}
    argv = _train_argv(tmp_path / "run", shared_data, "parallel.timeout_minutes=2")
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:  # until rank 0's store listens: the rank waits in the rendezvous
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == -signal.SIGTERM
    finally:
        held.close()
        proc.kill()
        proc.wait()


def test_a_save_that_cannot_be_written_leaves_the_earlier_checkpoints(finished, tmp_path, monkeypatch):
    """A full disk (torch's zip writer: "unexpected pos") during a save: one CheckpointError, nothing half-written."""
    from megaformer.checkpoint import CheckpointState, save_checkpoint
    from megaformer.checkpoint import save as save_module
    from megaformer.parallel import ParallelContext

    run = _copy_run(finished, tmp_path / "run")
    root = run / "checkpoints"
    before = {p.name: sha256_of(p / "meta.json") for p in list_checkpoints(root)}

    def full_disk(obj, path):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1234 vs 1200")

    monkeypatch.setattr(save_module, "atomic_torch_save", full_disk)
    state = CheckpointState(shard={"param": {}}, run={}, replica={}, rank={})
    with pytest.raises(
        CheckpointError, match=r"cannot write the checkpoint \(\[enforce fail.*earlier checkpoints are intact"
    ):
        save_checkpoint(root, 99, ParallelContext.single(), state, meta={}, keep_last=10)
    assert {p.name: sha256_of(p / "meta.json") for p in list_checkpoints(root)} == before
    assert not list(root.glob(".step-*")), "the unfinished save is removed"
    assert (root / "latest").read_text().strip() == "step-00000010"


def test_a_config_for_another_direction_is_refused_and_the_run_records_the_datas(finished, shared_data, tmp_path):
    """data.src_lang/tgt_lang were accepted and ignored: yy -> xx settings trained xx -> yy and recorded yy -> xx."""
    line = _one_line_error(_train(tmp_path / "run", shared_data, "data.src_lang=yy"), "data.src_lang=yy: the data at")
    assert "is xx -> yy (its manifest.json)" in line and "data.src_lang=xx data.tgt_lang=yy" in line, line
    assert not (tmp_path / "run").exists()
    recorded = (finished / "config.yaml").read_text()  # left empty in the config: the data's direction
    assert "src_lang: xx" in recorded and "tgt_lang: yy" in recorded, recorded


def test_a_valid_split_it_cannot_stream_is_refused_before_training(tmp_path):
    """Every valid sentence over data.max_len (a CR-only valid file is one long sentence): the run died at its
    first validation, after eval_interval steps, with nothing saved."""
    words = [f"w{i}" for i in range(40)]
    for prefix, count, length in (("train", 400, 3), ("valid", 5, 120)):
        for lang in ("en", "de"):
            lines = [" ".join(words[(i + j) % 40] for j in range(length)) for i in range(count)]
            (tmp_path / f"{prefix}.{lang}").write_text("\n".join(lines) + "\n")
    argv = ["prepare", "--train", str(tmp_path / "train"), "--valid", str(tmp_path / "valid")]
    assert cli.main([*argv, "--vocab-size", "44", "--out", str(tmp_path / "data"), "--quiet"]) == 0
    run = tmp_path / "run"
    proc = _train(run, tmp_path / "data", "data.max_len=64", "train.max_steps=4", "train.eval_interval=2")
    line = _one_line_error(proc, "split valid has no sample to stream: all 5 are longer than data.max_len=64")
    assert "raise data.max_len" in line and not re.search(r"step +\d+/4 \| loss", proc.stdout), proc.stdout[-2000:]
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())


def test_a_step_plan_no_micro_batch_can_hold_is_refused_before_any_process_starts(finished, shared_data, tmp_path):
    """100 tokens a step over 2 DP streams cannot hold a sentence of data.max_len=64 and its eos: every rank
    refused it after starting, and ``--check`` (slurm/common.sh's, before srun) passed it. A resume plans
    with its checkpoint's streams (meta.json): 1 here, whatever the DP size's."""
    sets = ("data.max_len=64", "train.tokens_per_step=100")
    for extra in (("--nproc", "2", "--check"), ("--nproc", "2")):
        line = _one_line_error(_train(tmp_path / "run", shared_data, *sets, extra=extra), "train.tokens_per_step=100")
        assert "over 2 data streams" in line and "raise train.tokens_per_step to at least 130" in line, line
        assert not (tmp_path / "run").exists()  # refused before any rank started
    run = _copy_run(finished, tmp_path / "resumed")  # one data stream
    fits = _train(run, shared_data, *sets, "train.max_steps=11", extra=("--check",))
    assert fits.returncode == 0 and "train: checked: 1 process" in fits.stdout, fits.stderr
    line = _one_line_error(
        _train(run, shared_data, "data.max_len=64", "train.tokens_per_step=50", extra=("--check",)), ""
    )
    assert "train.tokens_per_step=50 over 1 data stream (" in line and "at least 65" in line, line
