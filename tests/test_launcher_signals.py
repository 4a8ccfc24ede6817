"""Signals to a whole local run, and a launcher that dies: `megaformer train --nproc 2` on this machine.

The SLURM cluster tests (test_slurm_cluster.py) show the same through srun and torchrun;
these run without root or SLURM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus") / "synthetic"
    cmd = [sys.executable, "-m", "megaformer.cli", "prepare", "--synthetic", "300", "--out", str(out), "--quiet"]
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT, timeout=300)
    return out


def _start(corpus: Path, run: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_"))}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "megaformer.cli", "train", "--config", str(ROOT / "configs" / "tiny.yaml")]
    cmd += ["--run-dir", str(run), "--nproc", "2", "--set", f"data.path={corpus}", "--set", "train.max_steps=100000"]
    cmd += ["--set", "data.num_workers=1", "--set", "train.log_interval=1", "--set", "train.eval_interval=0"]
    cmd += ["--set", "data.max_tokens=256", "--set", "train.tokens_per_step=512", "--set", "parallel.backend=gloo"]
    out = open(run.parent / f"{run.name}.log", "w")  # noqa: SIM115 -- closed by the child's exit
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_step(run: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    metrics = run / "metrics.jsonl"
    while True:
        lines = metrics.read_text().splitlines() if metrics.is_file() else []
        if any(json.loads(line).get("step", 0) >= step for line in lines if line.strip()):
            return
        assert proc.poll() is None, (run.parent / f"{run.name}.log").read_text()[-3000:]
        assert time.monotonic() < deadline, f"step {step} not reached"
        time.sleep(0.5)


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def _children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in found]


def _ranks(launcher: int) -> list[int]:
    """The ranks `megaformer train --nproc` started: children of multiprocessing's fork server, its child."""
    cmdline = lambda pid: Path(f"/proc/{pid}/cmdline").read_bytes()  # noqa: E731
    servers = [p for p in _children(launcher) if b"forkserver" in cmdline(p)]
    return [rank for server in servers for rank in _children(server)]


def _signal_the_group(corpus: Path, tmp_path: Path, sig: signal.Signals) -> tuple[Path, int, str]:
    """``train --nproc 2`` with a loader worker, ``sig`` to its whole process group at step 3: (run, exit status, log)."""
    run = tmp_path / "run"
    proc = _start(corpus, run)
    _wait_step(run, 3, proc)
    os.killpg(proc.pid, sig)
    code = proc.wait(timeout=180)
    return run, code, (tmp_path / "run.log").read_text()


def test_usr1_to_the_process_group_saves_instead_of_killing_workers(corpus, tmp_path):
    """2f: `kill -USR1 -PGID`, as SLURM's step signals do: DataLoader workers ignore it, the ranks save."""
    run, code, log = _signal_the_group(corpus, tmp_path, signal.SIGUSR1)
    assert code == 0, log[-3000:]
    assert "is killed by signal" not in log and "after SIGUSR1" in log, log[-3000:]
    assert "USR1 outside a SLURM job: checkpoint saved" in log
    assert list((run / "checkpoints").glob("step-*/meta.json"))


def test_ctrl_c_saves_and_stops_every_rank_without_a_traceback(corpus, tmp_path):
    """Ctrl-C in a terminal: SIGINT to the whole process group (launcher, ranks, DataLoader workers). The
    ranks save and stop together as on SIGTERM, exit 130, and the workers live until their rank stops them."""
    run, code, log = _signal_the_group(corpus, tmp_path, signal.SIGINT)
    assert code == 130, log[-3000:]
    assert "Traceback" not in log and "KeyboardInterrupt" not in log and "failed" not in log, log[-3000:]
    assert "after SIGINT (saved)" in log, log[-3000:]
    saved = sorted((run / "checkpoints").glob("step-*/meta.json"))
    assert saved and json.loads(saved[-1].read_text())["reason"] == "SIGINT"


def test_ranks_do_not_outlive_their_launcher(corpus, tmp_path):
    """2g: the launcher killed outright: its ranks notice, save (the peers still agree) and exit."""
    run = tmp_path / "run"
    proc = _start(corpus, run)
    _wait_step(run, 3, proc)
    ranks = _ranks(proc.pid)
    assert len(ranks) == 2
    started = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    while _alive(ranks):
        assert time.monotonic() - started < 150, "ranks outlived their launcher"
        time.sleep(0.5)
    log = (tmp_path / "run.log").read_text()
    assert "is gone: saving and stopping" in log and "after SIGTERM (saved" in log, log[-3000:]
    assert list((run / "checkpoints").glob("step-*/meta.json"))


WORKERS_STARTING = """
import multiprocessing, os, signal, subprocess, sys
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from megaformer.data.workers import ignore_trainer_signals, start_workers

class Numbers(IterableDataset):
    def __iter__(self):
        info = get_worker_info()
        return iter(range(info.id, 40, info.num_workers))

if __name__ == "__main__":
    multiprocessing.set_start_method("spawn")  # what a rank inherits from the launcher
    got = []
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, lambda s, _: got.append(s))  # the rank's SignalWatch, reduced to a note
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1, signal.SIGTERM})  # as the watch does
    loader = DataLoader(Numbers(), batch_size=None, num_workers=2, worker_init_fn=ignore_trainer_signals)
    items = start_workers(loader)
    group = os.getpgid(0)  # the workers exist and are still importing torch; the sender is not their parent
    sender = f"import os; os.killpg({group}, {int(signal.SIGUSR1)}); os.killpg({group}, {int(signal.SIGTERM)})"
    subprocess.run([sys.executable, "-c", sender], check=True, start_new_session=True)
    print(sorted(items) == list(range(40)), sorted(got) == [signal.SIGUSR1, signal.SIGTERM])
"""


def test_group_signals_while_workers_start_reach_only_the_rank(tmp_path):
    """A USR1 or TERM to the process group in the seconds a spawned worker imports: the worker lives, the rank notes it."""
    script = tmp_path / "workers_starting.py"
    script.write_text(WORKERS_STARTING)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120, start_new_session=True
    )
    assert out.returncode == 0 and out.stdout.split() == ["True", "True"], out.stdout + out.stderr[-3000:]


AFTER_A_REQUEUE = """
import os, signal, sys
from launcher.env import slurm_job
from megaformer.train.launch import launch_scope
from megaformer.train.signals import SignalWatch

with launch_scope():
    watch = SignalWatch(slurm_job()[0])  # as rank_main passes it to the trainer
    watch.note_requeue()  # the trainer, stopping after a warning
    watch.restore()
    os.kill(os.getpid(), signal.SIGTERM)  # SLURM's, for the requeued attempt: this process goes on in a SLURM job
    print("teardown", flush=True)
os.kill(os.getpid(), signal.SIGTERM)  # or after the command returned, while the interpreter shuts down
print("exit", flush=True)
"""


@pytest.mark.parametrize("slurm", [True, False], ids=["slurm-job", "no-job"])
def test_after_a_requeue_slurms_sigterm_does_not_cut_the_ranks_teardown_short(slurm):
    """SLURM ends a requeued attempt with SIGTERM while the ranks close loaders and process groups: srun said
    "tasks 0-1: Terminated" and the next attempt took the lock over from a killed holder; and after the command
    returned, in the interpreter's shutdown. Outside a SLURM job nothing is requeued and nothing is ignored."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PYTHONPATH=str(ROOT), **({"SLURM_JOB_ID": "7"} if slurm else {}))
    proc = subprocess.run([sys.executable, "-c", AFTER_A_REQUEUE], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == (0 if slurm else -signal.SIGTERM), proc.stderr
    assert proc.stdout.split() == (["teardown", "exit"] if slurm else []), proc.stdout + proc.stderr
