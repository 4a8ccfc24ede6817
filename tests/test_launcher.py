"""Launch environment: SLURM host lists, `megaformer env`, TP groups inside nodes, failures surfaced."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher import local
from launcher.env import detect, expand_nodelist, parse_hostlist
from launcher.local import ExitWatch, first_failure_status, report_failures, spawn, unreported_kills
from megaformer.errors import ConfigError
from megaformer.parallel.groups import check_tp_within_nodes, describe_nodes
from megaformer.parallel.layout import ParallelLayout

ROOT = Path(__file__).resolve().parents[1]

# Every form SLURM's documentation shows for host lists (hostlist expressions), with the
# expansion it documents: prefixes and suffixes, zero padding, comma lists inside and
# outside brackets, several bracket groups (the leftmost varies slowest).
FORMS = {
    "n1": ["n1"],
    "n[1-3]": ["n1", "n2", "n3"],
    "gpu[01-03,07],login1": ["gpu01", "gpu02", "gpu03", "gpu07", "login1"],
    "a[098-101]": ["a098", "a099", "a100", "a101"],
    "a[8-11]": ["a8", "a9", "a10", "a11"],
    "node[1-2]-ib": ["node1-ib", "node2-ib"],
    "rack[1-2]-node[01-02]": ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"],
    "x,y[1,3-4]z,w": ["x", "y1z", "y3z", "y4z", "w"],
    "c[1-2]s[0-1]n[5]": ["c1s0n5", "c1s1n5", "c2s0n5", "c2s1n5"],
    "n[1-2],m[3],k": ["n1", "n2", "m3", "k"],
}


@pytest.mark.parametrize("hostlist", FORMS)
def test_parse_hostlist_documented_forms(hostlist):
    assert parse_hostlist(hostlist) == FORMS[hostlist]


@pytest.mark.parametrize("bad", ["n[1-2", "n1-2]", "n[a-b]", "n[3-1]", "n[[1]]"])
def test_parse_hostlist_refuses_malformed(bad):
    with pytest.raises(ConfigError, match="host list"):
        parse_hostlist(bad)


def test_parse_hostlist_agrees_with_scontrol(tmp_path):
    """Where SLURM is installed, its own expansion is the reference for every form it accepts."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        pytest.skip("SLURM's scontrol is not installed")
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=t\nSlurmctldHost=localhost\nNodeName=a\nPartitionName=p Nodes=a\n")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    compared = 0
    for hostlist in FORMS:
        proc = subprocess.run([scontrol, "show", "hostnames", hostlist], capture_output=True, text=True, env=env)
        if proc.returncode == 0 and proc.stdout.strip():  # 22.05 refuses a suffix after one bracket group
            ours, slurms = parse_hostlist(hostlist), proc.stdout.split()
            if hostlist.count("[") > 2 and hostlist.count(",") == 0:  # Slurm orders 3+ groups its own way
                assert (sorted(ours), ours[0]) == (sorted(slurms), slurms[0]), hostlist
            else:
                assert ours == slurms, hostlist
            compared += 1
    assert compared >= 6


def test_expand_nodelist_falls_back_without_scontrol():
    assert expand_nodelist("rack[1-2]-node[01-02]", scontrol="/bin/false") == FORMS["rack[1-2]-node[01-02]"]


def test_detect_slurm_master_is_first_host():
    env = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4"}
    env |= {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "rack[1-2]-node[01-02]", "PATH": "/nonexistent"}
    info = detect(env)
    assert (info.rank, info.local_rank, info.world_size, info.master_addr) == (3, 1, 4, "rack1-node01")


def test_env_command_under_fake_slurm():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_"))}
    env |= {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"}
    env |= {"SLURM_JOB_NODELIST": "rack[1-2]-node[01-02]", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "3"}
    env.pop("SLURM_CONF", None)
    proc = subprocess.run(
        [sys.executable, "-m", "megaformer.cli", "env", "--json"], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert found["launcher"] == "slurm" and found["master_addr"] == "rack1-node01"
    assert found["world_size"] == 4 and found["nodes"] == FORMS["rack[1-2]-node[01-02]"]
    assert found["omp_num_threads"] == "3" and found["device"] == "cpu"
    # the threads torch gives a process under this environment (OMP_NUM_THREADS=3, at most the cores here)
    torch_threads = [sys.executable, "-c", "import torch; print(torch.get_num_threads())"]
    assert found["threads"] == int(subprocess.run(torch_threads, capture_output=True, text=True, env=env).stdout)


def test_tp_groups_must_stay_inside_a_node():
    hosts = ["a", "a", "b", "b"]
    check_tp_within_nodes(ParallelLayout(4, 2, 2), hosts)
    assert describe_nodes(hosts) == "a: ranks 0,1; b: ranks 2,3"
    with pytest.raises(ConfigError, match=r"parallel.tp=4 .*ranks \[0, 1, 2, 3\] on a, b.*parallel.tp in \[1, 2\]"):
        check_tp_within_nodes(ParallelLayout(4, 4, 1), hosts)
    with pytest.raises(ConfigError, match="across nodes"):  # round-robin placement splits every pair
        check_tp_within_nodes(ParallelLayout(4, 2, 2), ["a", "b", "a", "b"])


def _fail_on_one_rank(bad: int) -> int:
    """Rank ``bad`` fails with a clear message; the others wait in a collective and lose their peer."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    if dist.get_rank() == bad:
        time.sleep(0.5)
        raise ConfigError("rank-specific bad input: set x.y to 3")
    dist.barrier()
    dist.barrier()
    return 0


def test_first_failing_rank_is_the_last_line(capfd):
    """Issue 14 item 5: the first failing rank's message ends the output, not a peer's gloo traceback."""
    code = spawn(_fail_on_one_rank, 3, 1, timeout_s=120)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2
    assert lines[-1] == "rank 1 failed first: error: rank-specific bad input: set x.y to 3", err[-2000:]
    assert "Traceback" not in err  # the peers' connection errors are one line each


def _killed_by(signum: int) -> int:
    os.kill(os.getpid(), signum)
    time.sleep(30)
    return 0


def test_a_rank_killed_by_a_signal_is_the_shells_status(capfd):
    """A rank killed by SIGKILL (the OOM killer) made `megaformer train --nproc` exit 247 (Python's -9 as a status)."""
    assert spawn(_killed_by, 1, signal.SIGKILL, timeout_s=120) == 128 + signal.SIGKILL
    assert capfd.readouterr().err.splitlines()[-1] == "rank 0 failed first: killed by signal SIGKILL"


def _wait_for(go: str | None) -> None:
    """Wait until the file ``go`` exists (the test's launcher has looked at the ranks once)."""
    deadline = time.monotonic() + 120
    while go is not None and not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.01)


def _killed_in_a_collective(victim: int, go: str | None = None) -> int:
    """Rank ``victim`` is SIGKILLed (the OOM killer, ``kill -9``) while its peers wait for it in a collective."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    dist.barrier()
    _wait_for(go)
    if dist.get_rank() == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    return 0


@pytest.mark.parametrize("late", [False, True], ids=["each-poll", "all-gone-by-the-next-look"])
def test_a_rank_killed_in_a_collective_is_named_first_not_the_peer_that_lost_it(capfd, monkeypatch, tmp_path, late):
    """The killed rank says nothing; its peers report "Connection closed by peer" at once, and the earliest
    report was named as the first failure (and its status returned) though it only followed the kill.
    Under load every rank had exited before the launcher looked again: no failure was read at all, and the
    first report was named."""
    clock = _late_looks(monkeypatch, limit_s=0, go=tmp_path / "go") if late else None
    code = spawn(_killed_in_a_collective, 4, 2, str(tmp_path / "go") if late else None, timeout_s=120)
    assert clock is None or clock.sleeps == 1  # the first look saw them running, the second all gone
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 128 + signal.SIGKILL, err[-2000:]
    assert lines[-1] == "rank 2 failed first: killed by signal SIGKILL", err[-2000:]
    assert "Traceback" not in err and "after rank 2 failed" in err, err[-2000:]  # a peer's line names it


def _done(go: str) -> int:
    _wait_for(go)
    return 0


class _LateLook:
    """The launcher's clock, but a poll's sleep lasts until its ranks have exited (the fork server has said so)
    and ``limit_s`` has passed: a launcher kept off the CPU for that long. The first sleep makes the file
    ``go``, which the ranks wait for: the first look sees them all running."""

    def __init__(self, limit_s: float, go: Path) -> None:
        self.procs: list = []
        self.limit_s, self.go, self.sleeps = limit_s, go, 0
        self.time, self.monotonic = time.time, time.monotonic

    def sleep(self, seconds: float) -> None:
        from multiprocessing.connection import wait

        self.sleeps += 1
        self.go.touch()
        until = time.monotonic() + self.limit_s  # the limit was set before the first look, which came before this
        for proc in self.procs:
            wait([proc.sentinel], timeout=120)
        time.sleep(max(0.0, until - time.monotonic()))


def _late_looks(monkeypatch, limit_s: float, go: Path) -> _LateLook:
    """Give ``spawn`` a :class:`_LateLook` clock that knows the ranks it starts."""
    clock = _LateLook(limit_s, go)
    add = ExitWatch.add
    monkeypatch.setattr(ExitWatch, "add", lambda watch, proc: (clock.procs.append(proc), add(watch, proc))[1])
    monkeypatch.setattr(local, "time", clock)
    return clock


def test_ranks_done_by_the_look_their_time_limit_passed_in_are_a_success(monkeypatch, tmp_path):
    """The limit was read before "all done": a run whose ranks finished in the poll the limit passed in (a
    launcher kept off the CPU for a poll) returned 124, the time limit's status, for a complete run."""
    clock = _late_looks(monkeypatch, limit_s=2, go=tmp_path / "go")
    assert spawn(_done, 1, str(tmp_path / "go"), timeout_s=2) == 0
    assert clock.sleeps == 1  # the first look saw the rank running, the second done, past its limit


def _sleeper() -> int:
    time.sleep(60)
    return 0


TERM_WHILE_STARTING = """
import os, signal, sys
import multiprocessing.process as mpp
from launcher.local import spawn
import test_launcher as t

real = mpp.BaseProcess.start
def start(self):
    real(self)
    os.kill(os.getpid(), signal.SIGTERM)  # to the launcher, between starting its first rank and its second
mpp.BaseProcess.start = start
print(spawn(t._sleeper, 2, timeout_s=100))
"""


def test_sigterm_while_the_launcher_starts_its_ranks_reaches_every_rank():
    """It killed the launcher and left the ranks started so far waiting in the rendezvous for the others."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    proc = subprocess.run(
        [sys.executable, "-c", TERM_WHILE_STARTING], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0 and proc.stdout.split() == [str(128 + signal.SIGTERM)], proc.stdout + proc.stderr
    assert proc.stderr.count("killed by signal SIGTERM") == 2, proc.stderr


_KEPT: list = []


def _keep_a_process_lock() -> int:
    """What tqdm does when dynamo traces a layer: a multiprocessing lock made and kept for the process's life."""
    import multiprocessing

    _KEPT.append(multiprocessing.RLock())
    return 0


def test_a_lock_a_rank_keeps_is_released_when_it_exits():
    """Ranks end with os._exit; the resource tracker warned of each kept lock as a leaked semaphore."""
    launch = "import sys; from launcher.local import spawn; import test_launcher as t; sys.exit(spawn(t._keep_a_process_lock, 2))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    proc = subprocess.run(
        [sys.executable, "-c", launch], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "leaked semaphore" not in proc.stderr, proc.stderr[-2000:]


def test_exit_status_is_the_first_reporters_when_peers_exit_in_the_same_poll():
    """Rank 1 failed first (status 2); rank 0 lost its peer (1) and exited within the same poll."""
    reports = [(10.2, 0, "RuntimeError: Connection closed by peer", "..."), (10.0, 1, "error: bad", "error: bad")]
    assert first_failure_status(reports, [1, 2, 1], polled=1) == 2
    assert first_failure_status([], [1, 2, 1], polled=1) == 1  # no report: what the loop saw
    assert first_failure_status(reports[:1], [1, None, 1], polled=1) == 1


def test_a_killed_rank_precedes_the_peers_that_reported_losing_it_within_the_poll():
    """Rank 2 SIGKILLed after the poll at 10.00; ranks 0 and 1 reported its loss at 10.02 and 10.03, and the
    poll at 10.05 saw all three gone: rank 2 failed first. A report before 10.00 was a failure of its own."""
    lost = [(10.03, 1, "RuntimeError: Connection closed by peer", "RuntimeError: closed"), (10.02, 0, "x", "x")]
    codes = [1, 1, -signal.SIGKILL, None]
    reports = lost + unreported_kills([0, 1, 2], codes, lost, seen=[10.0] * 4)
    lines = []
    report_failures(reports, [1, 1, -9, -15], stopped={3}, log=lines.append)
    assert lines[-1] == "rank 2 failed first: killed by signal SIGKILL", lines
    assert "rank 3: stopped by the launcher after rank 2 failed" in lines and len(lines) == 4, lines
    assert first_failure_status(reports, codes, polled=1) == -signal.SIGKILL
    own = [(9.0, 1, "error: bad", "error: bad")]  # a failure of its own, a second before: it stays first
    assert min(own + unreported_kills([1, 2], codes, own, seen=[10.0] * 4))[1] == 1
    aborted = [1, 1, -signal.SIGABRT, None]  # gloo's abort after a peer failed: not taken for the cause
    assert unreported_kills([2], aborted, lost, seen=[10.0] * 4) == []
    lines = []
    report_failures([], [-15, -15], stopped={0, 1}, why=" at its 60 s time limit", log=lines.append)
    assert lines == [f"rank {r}: stopped by the launcher at its 60 s time limit" for r in (0, 1)]


class _LateWord:
    """A rank as the launcher's ``Process`` shows it while the fork server has not yet told of its exit."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def is_alive(self) -> bool:
        return True


def _pidfds_work() -> bool:
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):  # not Linux, a kernel before 5.3, or a sandbox that forbids it
        return False
    return True


def _no_pidfd(pid: int) -> int:
    raise OSError(38, "Function not implemented")  # what a kernel before 5.3 says


@pytest.mark.parametrize("how", ["pidfd", "proc"])
def test_the_exit_watch_sees_a_killed_rank_gone_before_the_fork_server_tells(how, monkeypatch):
    """Under load the fork server's word of a kill came after the peers' reports (dated later than they).
    Where a kernel has no pidfd, /proc says the same: exited (a zombie), then gone (reaped)."""
    if how == "pidfd" and not _pidfds_work():
        pytest.skip("no pidfd here: /proc is read")
    if how == "proc":
        if not os.path.isdir("/proc/self"):
            pytest.skip("no /proc here: the fork server's word is used")
        monkeypatch.setattr(local.os, "pidfd_open", _no_pidfd)
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watch = ExitWatch()
    watch.add(_LateWord(victim.pid))
    try:
        assert (watch.fds[0] is None) == (how == "proc")
        watch.look()
        assert watch.running(0)
        before = watch.seen[0]
        victim.kill()
        os.waitid(os.P_PID, victim.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped: as a rank then is
        watch.look()
        assert not watch.running(0) and watch.seen[0] == before
        victim.wait()  # reaped
        assert not watch.running(0)
    finally:
        watch.close()
        victim.kill()
        victim.wait()


def _report_what_the_rank_took(out: str) -> int:
    import signal

    print(f"stdout of rank {os.environ['RANK']}", flush=True)
    print(f"stderr of rank {os.environ['RANK']}", file=sys.stderr, flush=True)
    blocked = sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))
    Path(out, f"rank{os.environ['RANK']}.json").write_text(json.dumps([os.environ.get("MF_SPAWN_PROBE"), blocked]))
    return 0


def test_each_spawn_passes_its_own_environment_signal_mask_and_output(tmp_path, capfd, monkeypatch):
    """The ranks fork from a server the first spawn started: a later spawn's variables, mask and output still reach them."""
    import signal

    assert spawn(_local_rank_of, 2, str(tmp_path)) == 0  # the server exists now, with this environment and mask
    capfd.readouterr()
    monkeypatch.setenv("MF_SPAWN_PROBE", "set after the server started")
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        assert spawn(_report_what_the_rank_took, 2, str(tmp_path)) == 0
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
    out, err = capfd.readouterr()
    assert sorted(out.split("\n")) == ["", "stdout of rank 0", "stdout of rank 1"]
    assert "stderr of rank 0" in err and "stderr of rank 1" in err
    for rank in (0, 1):
        probe, blocked = json.loads(Path(tmp_path, f"rank{rank}.json").read_text())
        assert probe == "set after the server started"
        assert signal.SIGUSR1 in blocked


def test_the_fork_servers_preload_calls_nothing_in_torch_cuda():
    """Ranks fork from the server: a CUDA it had initialized would be unusable in every one of them."""
    probe = """
import functools, inspect, json, torch
calls = []
def spy(name, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)
    return call
for name in dir(torch.cuda):
    if inspect.isfunction(getattr(torch.cuda, name)) and not name.startswith("__"):
        setattr(torch.cuda, name, spy(name, getattr(torch.cuda, name)))
for name in dir(torch._C):
    if name.startswith("_cuda_"):
        setattr(torch._C, name, spy(name, getattr(torch._C, name)))
from launcher.local import PRELOAD
for module in PRELOAD:
    __import__(module)
print(json.dumps(calls))
"""
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    harmless = {"_is_compiled"}  # whether torch was built with CUDA: no driver call
    assert set(json.loads(proc.stdout.splitlines()[-1])) <= harmless


def test_a_launch_of_local_ranks_imports_no_torch_in_the_launching_process(corpus, tmp_path):
    """`megaformer train --nproc 2` checks the config, layout and data, then only waits on its ranks:
    torch (~1.5 CPU seconds to import) is theirs, loaded once by the fork server they start from; a resume
    too. A bad data path is still refused there, before any rank starts."""
    probe = """
import sys
from megaformer import cli
code = cli.main(sys.argv[1:])
print("torch imported:", "torch" in sys.modules, "exit:", code)
"""
    args = ["train", "--config", ROOT / "configs" / "tiny.yaml", "--run-dir", tmp_path / "run", "--nproc", "2"]
    sets = ["data.num_workers=0", "train.max_steps=1", "train.tokens_per_step=512", "data.max_tokens=256"]
    args += [a for s in sets for a in ("--set", s)]
    resumed = ["--resume", "auto", "--set", "train.max_steps=2"]  # the plan check reads the checkpoint's meta.json
    for data, more, outcome in (
        (corpus, [], "exit: 0"),
        (corpus, resumed, "exit: 0"),
        (tmp_path / "missing", [], "exit: 2"),
    ):
        cmd = [sys.executable, "-c", probe, *map(str, args), "--set", f"data.path={data}", *more]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert proc.stdout.splitlines()[-1] == f"torch imported: False {outcome}", proc.stdout[-2000:] + proc.stderr
        assert (tmp_path / "run" / "checkpoints" / "step-00000001" / "meta.json").is_file()  # what the resume reads
    assert "no such manifest" in proc.stderr and "missing" in proc.stderr


def _local_rank_of(out: str) -> int:
    info = detect()
    Path(out, f"rank{info.rank}").write_text(str(info.local_rank))
    return 0


def test_local_processes_get_distinct_local_ranks(tmp_path):
    """Item 4: ranks started by launcher.local (translate/evaluate --tp N) see distinct local ranks."""
    assert spawn(_local_rank_of, 2, str(tmp_path)) == 0
    assert [Path(tmp_path, f"rank{r}").read_text() for r in range(2)] == ["0", "1"]


def test_gpu_binding_follows_what_the_task_sees(monkeypatch):
    """Item 8: one visible GPU (--gpus-per-task, --gpu-bind) -> cuda:0, else cuda:<local rank>."""
    import torch

    from megaformer.errors import ConfigError
    from megaformer.parallel.groups import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert pick_device("nccl", 3) == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert pick_device("nccl", 3) == torch.device("cuda", 3)
    assert pick_device("gloo", 3) == torch.device("cpu")
    # parallel.device=cuda with gloo: ranks may share GPUs (the GPU acceptance run puts two on one)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert [pick_device("gloo", r, "cuda") for r in (0, 1)] == [torch.device("cuda", 0)] * 2
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert pick_device("gloo", 3, "cuda") == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match="one GPU per rank"):
        pick_device("nccl", 2)  # nccl refuses two ranks on one GPU: say so before it does
    with pytest.raises(ConfigError, match="parallel.device"):
        pick_device("nccl", 0, "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no GPU is visible"):
        pick_device("gloo", 0, "cuda")


def test_process_group_timeout_comes_from_the_config(monkeypatch):
    import datetime

    import torch.distributed as dist

    from megaformer.config import ParallelConfig
    from megaformer.parallel.groups import ParallelContext

    seen = {}

    def fake_init(backend, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(dist, "init_process_group", fake_init)
    with pytest.raises(RuntimeError, match="stop here"):
        ParallelContext.initialize(ParallelConfig(timeout_minutes=2.5, backend="gloo"), 0, 2)
    assert seen["timeout"] == datetime.timedelta(minutes=2.5)


def _destroy_keeps_callers_world() -> int:
    import torch
    import torch.distributed as dist

    from megaformer.config import ParallelConfig
    from megaformer.parallel.groups import ParallelContext

    dist.init_process_group("gloo", init_method="env://")
    ctx = ParallelContext.initialize(ParallelConfig(tp=2, backend="gloo"), dist.get_rank(), 2)
    assert not ctx.owns_world and len(ctx.groups) == 3
    ctx.destroy()
    assert dist.is_initialized()
    t = torch.ones(1)
    dist.all_reduce(t)  # the caller's default group still works
    assert t.item() == 2
    dist.destroy_process_group()
    return 0


def test_destroy_ends_only_what_the_context_created():
    assert spawn(_destroy_keeps_callers_world, 2, timeout_s=240) == 0


def _meet_on_a_held_port() -> int:
    """No one else can bind the rendezvous port before rank 0's store does; the ranks still meet on it."""
    import errno
    import socket

    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
            return 3  # the port was free for anyone to take until rank 0 binds it
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise
    dist.init_process_group("gloo", init_method="env://")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return 0 if t.item() == 2 else 4


def test_the_rendezvous_port_is_held_until_the_ranks_exit():
    """A port only chosen (bound, then closed) was taken by another run's connection before rank 0 bound it."""
    assert spawn(_meet_on_a_held_port, 2, timeout_s=240) == 0


def test_one_process_needs_no_free_port(monkeypatch):
    """DeepSpeed's process group of a single process meets no one: a MASTER_PORT in use does not stop it."""
    import socket

    from megaformer.config import ParallelConfig
    from megaformer.parallel.groups import ParallelContext

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(taken.getsockname()[1]))
        ctx = ParallelContext.initialize(ParallelConfig(backend="gloo"), 0, 1, single_process_group=True)
        try:
            assert ctx.owns_world and ctx.dp_group is not None
        finally:
            ctx.destroy()


def test_env_command_outside_slurm_says_there_is_no_node_list():
    """The `nodes` line was blank outside SLURM."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "megaformer.cli", "env"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "nodes                  (no SLURM node list: this host)" in proc.stdout.splitlines(), proc.stdout


RANK_THAT_STOPS = """
import os, signal, sys, time
signal.signal(signal.SIGUSR1, lambda *_: None)  # the trainer: saves at the end of its step, requeues
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # saves, exits 143
open(sys.argv[1], "w").close()
time.sleep(120)
"""


@pytest.mark.parametrize(
    "signals, status",
    [((signal.SIGTERM,), 143), ((signal.SIGUSR1, signal.SIGTERM), 128 + signal.SIGUSR1)],
    ids=["scancel", "requeue"],
)
def test_torchrun_stopped_by_a_signal_is_a_status_not_a_traceback(tmp_path, signals, status):
    """LAUNCHER=torchrun: every requeue and scancel ended with torchrun's SignalException traceback and status 1.
    A requeue is the warning, then SLURM's SIGTERM during the shutdown it began: the warning is named."""
    script, ready = tmp_path / "rank.py", tmp_path / "ready"
    script.write_text(RANK_THAT_STOPS)
    argv = [sys.executable, "-m", "launcher.torchrun", "--standalone", "--nproc-per-node", "1"]
    argv += ["--signals-to-handle", "SIGTERM,SIGINT,SIGUSR1", str(script), str(ready)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_"))}
    env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = "60"  # the rank takes its time over a USR1, as a saving trainer does
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        for sig in signals:
            proc.send_signal(sig)
            time.sleep(1)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == status and "Traceback" not in err, err[-3000:]
    last = f"torchrun: stopped by {signals[0].name}, passed on to the ranks: exit {status}"
    assert err.strip().splitlines()[-1] == last, err[-3000:]


RANK_THAT_FAILS = """
import os, signal, sys, time
if os.environ["RANK"] == "1":
    time.sleep(1)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    print("megaformer train: error: a setting of rank 1", file=sys.stderr)
    sys.exit(2)
time.sleep(120)
"""


@pytest.mark.parametrize(
    "how, status, said",
    [("exit", 2, "exit 2"), ("kill", 128 + signal.SIGKILL, "killed by SIGKILL")],
    ids=["error", "signal"],
)
def test_torchrun_with_a_failed_rank_ends_on_one_line_with_the_ranks_status(tmp_path, how, status, said):
    """LAUNCHER=torchrun: a rank's failure ended with torchrun's traceback, a table of every rank and status 1."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_THAT_FAILS)
    argv = [sys.executable, "-m", "launcher.torchrun", "--standalone", "--nproc-per-node", "2", str(script), how]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_"))}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == status and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("torchrun: rank 1 (local rank 1 on ") and f"failed first ({said}" in last, proc.stderr
    assert last.endswith(f"its message, if any, is above: exit {status}"), proc.stderr
    if how == "exit":
        assert "megaformer train: error: a setting of rank 1" in proc.stderr
