"""The SLURM path on a real two-node cluster (slurm/testcluster.sh): sbatch, srun, signals, requeue.

The cluster (slurmctld and two slurmd, each node in its own network namespace) is brought
up once per test session. Where it cannot be (not root, SLURM missing and apt unreachable)
the tests fail with the reason under CI=true and are skipped with it elsewhere.
Jobs run slurm/train_tiny.sh, the script users run, with the tiny config: TP=2 inside
each node, DP=2 across the two nodes, gloo over the veth links.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_helpers import FAKES

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "slurm" / "testcluster.sh"
# slurmctld looks for due --signal warnings every 30 s, so a warning due at a job's start reaches
# it up to ~30 s later; the preempted job (the reference's length) must still be training then.
# Every step of every job ends SLOW_MS later (tests/fakes: the `slow` fault), so 150 steps last
# over a minute on 2 idle cores (~0.1 s of computing a step) while computing less than half as
# long as the 400 unslowed steps this took before; and the jobs that run until a test stops them
# wait for SLURM's requeues and restarts without keeping both cores busy all that while.
STEPS = 150
SLOW_MS = 300
COMMON = ["--set", "data.max_tokens=256", "--set", "train.tokens_per_step=512", "--set", "train.log_interval=1"]
COMMON += ["--set", "train.eval_interval=0", "--set", "data.num_workers=1", "--set", "parallel.timeout_minutes=1"]
COMMON += ["--set", "train.peak_tflops=0.1"]  # MFU's denominator given, not timed by every rank (train_helpers)
# Namespace names of this session's cluster: its own, so that two sessions cannot take each other's down.
PREFIX = f"mft{os.getpid() % 100000}"
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL", "OUT_OF_MEMORY"}


def _unavailable(reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"SLURM test cluster unavailable in CI: {reason}")
    pytest.skip(f"SLURM test cluster unavailable: {reason}")


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """The cluster, up for the whole session; down at the end, with nothing left behind."""
    if os.geteuid() != 0:
        _unavailable("needs root (network namespaces and daemons)")
    if shutil.which("nsenter") is None or shutil.which("ip") is None:
        _unavailable("nsenter / ip (util-linux, iproute2) are not installed")
    os.environ["MF_SLURM_PREFIX"] = PREFIX
    up = subprocess.run([str(CLUSTER), "up"], capture_output=True, text=True, timeout=300)
    if up.returncode != 0:
        _unavailable((up.stderr.strip().splitlines() or ["slurm/testcluster.sh up failed"])[-1])
    work = tmp_path_factory.mktemp("slurm")
    corpus = work / "corpus"
    prep = [sys.executable, "-m", "megaformer.cli", "prepare", "--synthetic", "300", "--out", str(corpus), "--quiet"]
    subprocess.run(prep, check=True, capture_output=True, cwd=ROOT, timeout=300)
    try:
        yield Cluster(work, corpus)
    finally:
        down = subprocess.run([str(CLUSTER), "down"], capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stderr
        assert PREFIX not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        left = subprocess.run(["pgrep", "-f", f"testcluster-{PREFIX}/"], capture_output=True, text=True).stdout
        assert not left, f"processes left behind: {left}"


class Cluster:
    """sbatch / scontrol against the test cluster, and what a job left in its run directory."""

    def __init__(self, work: Path, corpus: Path) -> None:
        self.work, self.corpus = work, corpus
        self.env = {
            k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_"))
        }
        self.env.update(
            PYTHONPATH=f"{FAKES}{os.pathsep}{ROOT}",
            MEGAFORMER_TEST_FAULT=f"slow:step={SLOW_MS}",
            PYTHON=sys.executable,
        )

    def slurm(self, *args: str, check: bool = True) -> str:
        proc = subprocess.run(
            [str(CLUSTER), "exec", *args], capture_output=True, text=True, cwd=ROOT, env=self.env, timeout=60
        )
        assert proc.returncode == 0 or not check, f"{args}: {proc.stderr}"
        return proc.stdout

    def submit(
        self, name: str, *sbatch: str, steps: int = STEPS, launcher: str = "srun", extra: tuple[str, ...] = ()
    ) -> tuple[str, Path, Path]:
        run, out = self.work / name, self.work / f"{name}.out"
        self.env.update(RUN_DIR=str(run), LAUNCHER=launcher)
        args = ["--set", f"data.path={self.corpus}", "--set", f"train.max_steps={steps}", *COMMON, *extra]
        job = self.slurm("sbatch", "--parsable", f"--output={out}", *sbatch, "slurm/train_tiny.sh", *args).strip()
        return job.split(";")[0], run, out

    def job(self, job: str) -> dict[str, str]:
        """The job's fields. A query that fails is asked again twice, a second apart: scontrol was seen
        killed by SIGPIPE, printing nothing, while slurmctld handled the job's scancel on loaded cores."""
        for attempt in range(3):
            text = self.slurm("scontrol", "show", "job", "-o", job, check=attempt == 2)  # the last names its error
            if text.strip():
                break
            time.sleep(1)
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def nodes_settled(self) -> bool:
        """No node is still completing a previous job step (killing and cleaning up its tasks)."""
        states = self.slurm("sinfo", "-h", "-N", "-o", "%T", check=False).lower()
        return bool(states.strip()) and "comp" not in states and "drain" not in states

    def restart_now(self, job: str, timeout: float = 240, *update: str) -> None:
        """Wait until ``job`` has been requeued once, then let it start at once: SLURM holds a
        requeued job back for about two minutes (an operator can do the same). It is released only
        once the nodes have finished the previous attempt's step: a batch script launched on a node
        still completing the old one fails before it starts. Nor within the second SLURM revoked
        the previous attempt's credential: slurmd refuses a launch credential no newer than the
        revocation (``ctime <= revoked``), the batch script never runs and the job ends FAILED
        (exit 1, run time 0). The job shows PENDING only once the requeue is complete, after the
        revocation; SLURM's own hold exists for this, so the release waits 3 s from then. A job
        that ended without restarting fails the test at once, with its output; a second attempt
        that already ended is for the caller to judge."""
        deadline, pending_since = time.monotonic() + timeout, None
        while True:
            info = self.job(job)
            if info.get("Restarts") == "1" and info.get("JobState") in {"RUNNING", *ENDED}:
                return
            if info.get("JobState") in ENDED:
                output = Path(info["StdOut"]).read_text() if info.get("StdOut") else ""
                raise AssertionError(f"job {job} ended instead of restarting: {info}\n{output[-4000:]}")
            pending = info.get("Restarts") == "1" and info.get("JobState") == "PENDING"
            pending_since = (pending_since or time.monotonic()) if pending else None
            if pending and time.monotonic() >= pending_since + 3 and self.nodes_settled():  # until SLURM takes it
                self.slurm("scontrol", "update", f"JobId={job}", *update, "StartTime=now", check=False)
            assert time.monotonic() < deadline, f"job {job} not requeued and restarted after {timeout} s: {info}"
            time.sleep(1)

    def wait_state(self, job: str, states: set[str], timeout: float, run: Path | None = None) -> dict[str, str]:
        """``job``'s state once it is one of ``states``. With ``run`` (the job's run directory), each new step it
        logs keeps the wait going for half of ``timeout`` more, up to three times it in all: a loaded machine
        trains slower, and only a job that stops making progress fails the test."""
        began = time.monotonic()
        deadline, steps = began + timeout, 0
        while time.monotonic() < deadline:
            info = self.job(job)
            if info.get("JobState") in states:
                return info
            if run is not None and (step := max(losses(run), default=0)) > steps:
                steps, deadline = step, max(deadline, min(began + 3 * timeout, time.monotonic() + timeout / 2))
            time.sleep(1)
        raise AssertionError(f"job {job} not in {states} after {time.monotonic() - began:.0f} s: {self.job(job)}")


def losses(run: Path) -> dict[int, float]:
    """step -> training loss, the last record of each step (a resumed run repeats none)."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if r.get("kind") == "train"}


def wait_step(run: Path, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while max(losses(run), default=0) < step:
        assert time.monotonic() < deadline, f"{run}: step {step} not reached in {timeout} s"
        time.sleep(0.5)


def saved_steps(run: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*/meta.json"))


@pytest.fixture(scope="session")
def reference(cluster):
    """2a, the uninterrupted job: TP=2 in each node, DP=2 across them; its loss curve is the reference."""
    job, run, out = cluster.submit("reference")
    info = cluster.wait_state(job, ENDED, timeout=240, run=run)
    log = out.read_text()
    assert info["JobState"] == "COMPLETED", log[-3000:]
    return run, log


def test_two_nodes_tp_inside_dp_across(reference):
    run, log = reference
    assert "tp=2 dp=2" in log
    # every rank gathered its host name: TP group [0, 1] on n1, [2, 3] on n2 (initialize refuses a split group)
    assert "parallel: tp=2 dp=2; n1: ranks 0,1; n2: ranks 2,3" in log
    assert sorted(losses(run)) == list(range(1, STEPS + 1))


def test_preempted_job_requeues_once_and_matches_uninterrupted(cluster, reference):
    """2b: SLURM's --signal=B:USR1 before the time limit: save, real scontrol requeue, resume, same curve."""
    # The warning is due 10 s in and comes at slurmctld's next periodic check (STEPS above): before,
    # during or after the ranks' start-up, which they survive; they take it at the end of a step.
    job, run, out = cluster.submit("preempted", "--time=3", "--signal=B:USR1@170")
    # The second attempt would be warned again 10 s in; a longer limit lets it finish (the job
    # requeued itself once).
    cluster.restart_now(job, 240, "TimeLimit=10")
    info = cluster.wait_state(job, ENDED, timeout=300, run=run)
    log = out.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log[-3000:]
    assert log.count("(requeued)") == 1 and "(restart 1)" in log, log[-3000:]
    assert "train: resumed from" in log, log[-3000:]
    # The requeue's SIGTERM came while the ranks closed their loaders and process groups, and killed them
    # (srun's line; the batch shell's own `sleep` may be "Terminated" by it too, which is no matter).
    assert not re.search(r"srun: error: \S+: tasks? [\d,-]+: Terminated", log) and "took over" not in log, log[-3000:]
    assert losses(run) == losses(reference[0])  # fp32, dropout on: bitwise the uninterrupted curve


def test_scancel_saves_and_operator_requeue_resumes(cluster):
    """2c: an operator's `scontrol requeue` resumes from the last checkpoint; `scancel` saves, no requeue."""
    job, run, out = cluster.submit("operator", steps=10_000)
    wait_step(run, 5)
    cluster.slurm("scontrol", "requeue", job)
    cluster.restart_now(job)
    wait_step(run, max(saved_steps(run), default=0) + 5)
    first = saved_steps(run)
    assert first, out.read_text()[-3000:]
    cluster.slurm("scancel", job)
    info = cluster.wait_state(job, {"CANCELLED", "COMPLETED", "FAILED"}, timeout=120)
    log = out.read_text()
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "1", log[-3000:]
    assert f"resumed from {run}/checkpoints/step-{first[0]:08d}" in log  # the second attempt resumed the first's save
    assert log.count("after SIGTERM (saved)") >= 2, log[-3000:]  # requeue and scancel both save
    assert saved_steps(run)[-1] > first[0]


def _task_pids(node: str, run: Path) -> list[int]:
    """Pids of the training processes of ``run`` (ranks, not torchrun) on one node of the cluster."""
    return [p for p in _pids(node, "megaformer.cli", str(run)) if p not in _pids(node, "launcher.torchrun")]


def test_lost_node_ends_job_and_resubmission_resumes(cluster):
    """2d: the tasks of n2 SIGKILLed: the job ends naming the lost node, a resubmission resumes."""
    job, run, out = cluster.submit("lost", "--no-requeue", steps=10_000, extra=("--set", "train.save_interval=5"))
    wait_step(run, 7)
    pids = _task_pids("n2", run)
    assert pids
    started = time.monotonic()
    killed = 0
    for pid in pids:
        try:
            os.kill(pid, 9)
            killed += 1
        except ProcessLookupError:  # a process that ended between the listing and the kill (a forked worker)
            pass
    assert killed, pids
    info = cluster.wait_state(job, {"FAILED", "CANCELLED", "COMPLETED", "NODE_FAIL"}, timeout=90)
    took = time.monotonic() - started
    log = out.read_text()
    assert info["JobState"] == "FAILED" and took < 90, log[-3000:]
    assert re.search(r"n2: tasks? 2-3: Killed|n2: task 2: Killed|n2: task 3: Killed", log), log[-3000:]
    # resubmit with a short run: it must resume from the last complete checkpoint
    done = saved_steps(run)
    job2, _, out2 = cluster.submit(
        "lost", steps=(done[-1] if done else 0) + 3, extra=("--set", "train.save_interval=5")
    )
    cluster.wait_state(job2, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=180)
    log2 = out2.read_text()
    if done:
        assert f"resumed from {run}/checkpoints/step-{done[-1]:08d}" in log2, log2[-3000:]
    assert saved_steps(run)[-1] == (done[-1] if done else 0) + 3, log2[-3000:]


def test_signal_to_every_process_requeues_once(cluster):
    """2f: `scancel --signal=USR1` reaches every process of the step, DataLoader workers included."""
    job, run, out = cluster.submit("allsignal", steps=60)
    wait_step(run, 3)
    cluster.slurm("scancel", "--signal=USR1", job)
    cluster.restart_now(job)
    info = cluster.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=240, run=run)
    log = out.read_text()
    assert "is killed by signal" not in log, log[-3000:]
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log[-3000:]
    assert log.count("(requeued)") == 1, log[-3000:]


def _pids(node: str, *needles: str) -> list[int]:
    """Pids of the processes in a node's namespace whose command line holds every needle."""
    pids = subprocess.run(["ip", "netns", "pids", f"{PREFIX}{node}"], capture_output=True, text=True).stdout.split()
    found = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if Path(cmd.split("\0")[0]).name == "srun":  # srun's own command line names what it starts
            continue
        if all(n in cmd for n in needles):
            found.append(int(pid))
    return found


def test_torchrun_across_nodes_usr1_requeues_and_ranks_die_with_it(cluster):
    """2e + 2g: one torchrun per node (c10d rendezvous on the first node) trains the layout; USR1
    through torchrun (--signals-to-handle) saves and requeues; torchrun killed outright: its ranks
    (sessions of their own) notice, save and exit within a bounded time."""
    job, run, out = cluster.submit("torchrun", steps=10_000, launcher="torchrun")
    wait_step(run, 3)
    log = out.read_text()
    assert "tp=2 dp=2" in log
    assert re.search(r"parallel: tp=2 dp=2; n(\d): ranks 0,1; n(?!\1)\d: ranks 2,3", log), log[-3000:]
    cluster.slurm("scancel", "--signal=USR1", job)  # to the step's tasks: the two torchrun processes
    cluster.restart_now(job)
    first = saved_steps(run)
    assert first, out.read_text()[-3000:]
    wait_step(run, first[-1] + 3)
    launchers = _pids("n1", "launcher.torchrun", str(run)) + _pids("n2", "launcher.torchrun", str(run))
    assert len(launchers) == 2
    started = time.monotonic()
    for pid in launchers:
        os.kill(pid, 9)
    info = cluster.wait_state(job, {"FAILED", "CANCELLED", "COMPLETED"}, timeout=180)
    deadline = time.monotonic() + 60
    while _task_pids("n1", run) + _task_pids("n2", run):  # ranks left behind by slurmstepd
        assert time.monotonic() < deadline, "ranks outlived their launcher"
        time.sleep(0.5)
    took = time.monotonic() - started
    log = out.read_text()
    assert log.count("(requeued)") == 1 and "train: resumed from" in log, log[-3000:]
    assert "is gone: saving and stopping" in log, log[-3000:]
    # torchrun raised SignalException out of its main at the requeue: a traceback per node, status 1
    assert "Traceback" not in log and "torchrun: stopped by SIGUSR1" in log, log[-3000:]
    assert took < 150 and info["JobState"] in {"FAILED", "COMPLETED"}, log[-3000:]


def test_make_wmt14_submits_through_train_big_and_scores_the_averaged_model(cluster):
    """The WMT'14 recipe under SLURM: prepare from WMT-shaped archives, `sbatch --wait slurm/train_big.sh` (its GPU
    request set to none: the test cluster has no GPUs), average and score; tiny shapes, DP=2 across the nodes."""
    from wmt14_tree import build_wmt14_tree, make_wmt14

    raw, work = build_wmt14_tree(cluster.work / "wmt14-raw"), cluster.work / "wmt14"
    sbatch = "--nodes=2 --ntasks-per-node=1 --gpus-per-node=0 --cpus-per-task=1 --time=10"
    env = {**cluster.env, "MEGAFORMER_TEST_FAULT": ""}
    env.pop("RUN_DIR", None), env.pop("LAUNCHER", None)
    proc = make_wmt14(
        raw,
        work,
        "WMT14_LAUNCH=auto",  # the controller answers sinfo through the same wrapper: SLURM is taken
        f"WMT14_SBATCH={CLUSTER} exec sbatch",
        f"WMT14_SBATCH_ARGS={sbatch}",
        "WMT14_AVERAGE=2",
        env=env,
        timeout=600,
    )
    (job_log,) = work.glob("train-*.out")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:] + job_log.read_text()[-3000:]
    assert "through slurm/train_big.sh (sbatch --wait)" in proc.stdout and "slurm/train_big.sh --set" in proc.stdout
    log = job_log.read_text()
    assert "on 2 node(s)" in log and "tp=1 dp=2" in log, log[-3000:]
    assert sorted(losses(work / "run"))[-1] == 40
    assert "averaged 2 models" in proc.stdout + proc.stderr
    assert re.search(r"^tokenized compound-split BLEU = \d+\.\d\d", proc.stdout, re.M), proc.stdout[-2000:]
    assert len((work / "newstest2014.hyp").read_text().splitlines()) == 20
