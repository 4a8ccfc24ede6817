"""Start N local processes (gloo on a CPU), one per rank, and wait for all of them.

Used when a multi-rank command (``megaformer parity``, ``megaformer train --nproc N``,
``translate``/``evaluate --tp N``, the tests) runs outside any launcher. Each child gets
the variables torchrun would set (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
If one rank fails, the others are stopped instead of waiting forever in a collective, and
the first failing rank's message is printed last, on one line, after one line per peer
(instead of the peers' gloo "Connection closed by peer" tracebacks burying it).

Why not torch's elastic launch API (``torch.distributed.launcher.api.elastic_launch``, what
torchrun runs)? Tried (torch 2.13, two local workers): a failing worker does stop the others,
and with ``signals_to_handle=...SIGUSR1`` the agent passes USR1 on -- as a "death signal":
it then waits ``shutdown_timeout`` and SIGKILLs, and ``elastic_launch`` raises
``SignalException`` without the workers' exit statuses, so a caller cannot tell "saved and
requeued" (0) from "failed". A worker failure comes back as a ``ChildFailedError`` table after
every worker's traceback, each line prefixed by the logger -- the opposite of one clear line.
Without ``signals_to_handle`` it dies of USR1 and leaves its workers running (measured; the
cluster test runs torchrun that way). So this launcher stays: it forwards TERM,
INT and USR1 to every rank and waits for them, and ``megaformer train --nproc N`` saves and
requeues on USR1 like ``srun`` does. torchrun remains the way to start ranks on several nodes
(``slurm/common.sh`` ``LAUNCHER=torchrun``, with ``--signals-to-handle``).

The ranks are forked from multiprocessing's fork server (:data:`PRELOAD`), not started as
fresh interpreters: each takes this process's environment, signal mask and standard output
and error as they are when it starts (:class:`_Parent`), as a spawned one would. A rank's
parent is the server, which lives on while its ranks do: a training rank's watchdog
(:mod:`megaformer.train.signals`) watches this process through ``multiprocessing.parent_process()``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import select
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing import util as mp_util
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import DupFd
from typing import Any


def free_port() -> int:
    """A port free now; another process may take it before it is used (:func:`reserve_port` holds one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reserve_port() -> socket.socket:
    """A socket bound to a free port of 127.0.0.1, holding it for the ranks' rendezvous until closed.

    Bound with SO_REUSEADDR and not listening: no other bind and no outgoing connection is
    given the port, while rank 0's TCPStore, which binds with SO_REUSEADDR too (torch's
    libuv and legacy servers alike), can listen on it. A port only chosen (bound, then
    closed) was taken in the seconds before rank 0 bound it, by one of the many connections
    gloo opens, in a suite of concurrent runs: the ranks failed with EADDRINUSE.
    """
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s


# What the fork server imports once, so that no rank imports it again: torch, and
# torch._dynamo, which the first torch.optim optimizer imports. A fresh interpreter spends
# ~2.5 CPU seconds on them (2 cores, torch 2.13), most of a rank's start-up, and a
# 3-step `megaformer train --nproc 2` took ~21 % less CPU forked than spawned. Importing
# them runs no kernel and touches no CUDA (forked children could not use a CUDA the
# server had initialized): tests/test_launcher.py checks the preload calls nothing in
# torch.cuda.
PRELOAD = ("torch", "torch._dynamo")


class _Parent:
    """What a rank takes from the process starting it now, where the fork server holds an older copy.

    The server was started by this process's first :func:`spawn`; a later one may run with
    another environment, signal mask or standard output and error (pytest captures each
    test's). Pickled for each rank as it starts: the descriptors travel with it then.
    """

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self.blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])

    def __getstate__(self) -> dict:
        return {**self.__dict__, "stdio": (DupFd(1), DupFd(2))}  # inside Process.start(): sent to the child

    def adopt(self) -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, self.blocked)
        for target, inherited in zip((1, 2), self.stdio):
            fd = inherited.detach()
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(self.environ)


def _interrupt_once(signum: int, frame: object, fired: list[bool] = []) -> None:  # noqa: B006 (the once flag)
    """Ctrl-C reaches a rank twice (the terminal's, to the process group, and the launcher's forwarded copy): the
    first is a KeyboardInterrupt, later ones do nothing. A second one raised while the rank reported the first
    printed a traceback. Re-entered before the flag is set, the inner call's exception unwinds the outer one: one."""
    if fired:
        return
    fired.append(True)
    raise KeyboardInterrupt


def _entry(
    fn: Callable[..., int | None],
    rank: int,
    world_size: int,
    port: int,
    threads: int,
    args: tuple,
    errors: Any,
    parent: _Parent,
) -> None:
    signal.signal(signal.SIGINT, _interrupt_once)
    parent.adopt()
    # The rank's own processes (DataLoader workers) start fresh, as its children: not from a
    # fork server of its own, which would outlive it (torch's workers watch their parent).
    mp.set_start_method("spawn", force=True)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch

    torch.set_num_threads(threads)
    from megaformer.errors import MegaformerError

    report = None
    try:
        code = fn(*args)
    except MegaformerError as err:
        code, report = 2, (f"error: {err}", f"error: {err}")
    except KeyboardInterrupt:  # Ctrl-C before training began (after, the trainer saves and stops): no traceback
        code = 130
    except BaseException as err:  # a bug or a lost peer: the launcher decides what to show
        code, report = (
            1,
            (traceback.format_exc().rstrip(), f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"),
        )
    if report is not None:
        errors.put((time.time(), rank, *report))
    errors.close()
    errors.join_thread()
    # os._exit skips the interpreter's exit and so multiprocessing's finalizers: a semaphore a
    # library made in this rank and kept (tqdm's lock, made when dynamo traces a layer) would stay
    # registered, and the resource tracker would print a "leaked semaphore" warning at shutdown.
    # Python's own exit runs these first (multiprocessing.util._exit_function).
    mp_util._run_finalizers(0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))


def report_failures(
    reports: list[tuple[float, int, str, str]],
    codes: list[int | None],
    *,
    stopped: set[int] | frozenset[int] = frozenset(),
    why: str = "",
    log=print,
) -> None:
    """Print the failures of a run so that the first failing rank's message is the last line.

    Ranks that failed later (typically gloo's "Connection closed by peer" after the first one
    died) get one line each, before it; a rank killed by a signal is named with the signal, one
    the launcher stopped itself (``stopped``; ``why``, where no rank failed: its time limit) as such.
    """
    reports = sorted(reports)
    reported = {rank for _, rank, _, _ in reports}
    after = f" after rank {reports[0][1]} failed" if reports else why
    for rank, code in enumerate(codes):
        if code is not None and code < 0 and rank not in reported:
            name = signal.Signals(-code).name
            log(
                f"rank {rank}: stopped by the launcher{after}"
                if rank in stopped
                else f"rank {rank}: killed by signal {name}"
            )
    for _, rank, _, short in reports[1:]:
        log(f"rank {rank}: stopped after rank {reports[0][1]} failed ({short.strip()})")
    if reports:
        _, rank, full, _ = reports[0]
        log(f"rank {rank} failed first: {full}")


# Signals a rank dies of on its own, sending no report: a kill -9 or the OOM killer, a crash. Not SIGABRT,
# which a rank's runtime raises after a peer failed (gloo's "terminate called"), nor the launcher's SIGTERM.
CRASHES = (signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE)
# How much earlier than the last look that saw it running such a rank may have died: its sockets close (and
# its peers report) a moment before the kernel marks it exited; where no pidfd is had, the fork server's word
# of the exit is the look, and that can come late under load.
EXIT_NEWS_LAG_S = 0.5
# How often the launcher looks at its ranks.
POLL_S = 0.05


class ExitWatch:
    """When each rank was last seen running.

    A pidfd (Linux 5.3 on) becomes readable the moment its process exits, so the time is exact
    to a poll. Without one (an older kernel, a sandbox that forbids it, a rank gone before it was
    opened) the process's state in /proc is read (``Z``: exited, not yet reaped; no entry, or
    another start time: reaped); without /proc the fork server's word is used, which under load
    came more than a second after the killed rank's peers had reported.
    """

    def __init__(self) -> None:
        self.procs: list[BaseProcess] = []
        self.fds: list[int | None] = []
        self.started: list[str | None] = []  # /proc's start time of each rank without a pidfd
        self.seen: list[float] = []

    def add(self, proc: BaseProcess) -> None:
        """Watch ``proc``, just started (the sooner, the smaller the chance that it exited and its pid was reused)."""
        try:
            fd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):  # not Linux, or the rank already exited and was reaped
            fd = None
        stat = _proc_stat(proc.pid) if fd is None else None
        self.procs.append(proc)
        self.fds.append(fd)
        self.started.append(stat[1] if stat is not None else None)
        self.seen.append(time.time())

    def running(self, rank: int) -> bool:
        fd = self.fds[rank]
        if fd is not None:
            poller = select.poll()  # not select.select: it refuses a descriptor numbered 1024 or more
            poller.register(fd, select.POLLIN)
            return not poller.poll(0)
        if self.started[rank] is None:  # no /proc (or the rank was gone before it was looked at)
            return self.procs[rank].is_alive()
        stat = _proc_stat(self.procs[rank].pid)
        return stat is not None and stat[1] == self.started[rank] and stat[0] not in ("Z", "X")

    def look(self) -> None:
        now = time.time()
        for rank in range(len(self.procs)):
            if self.running(rank):
                self.seen[rank] = now

    def close(self) -> None:
        """Close the pidfds; later questions about those ranks are answered by the fork server's word."""
        for rank, fd in enumerate(self.fds):
            if fd is not None:
                os.close(fd)
                self.fds[rank] = None


def _proc_stat(pid: int | None) -> tuple[str, str] | None:
    """A process's state and start time from /proc; None where there is no such entry (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # after the command's name, which may hold ")"
    except (OSError, IndexError):
        return None
    return fields[0], fields[19]  # fields 3 and 22 of proc(5)


def unreported_kills(
    ranks: list[int], codes: list[int | None], reports: list[tuple[float, int, str, str]], seen: list[float]
) -> list[tuple[float, int, str, str]]:
    """Reports for those of ``ranks`` that died of a signal in :data:`CRASHES`, which sent none, dated when the
    launcher last saw them running (``seen``, by rank; less :data:`EXIT_NEWS_LAG_S`).

    Their peers report "Connection closed by peer" at once: before the launcher sees the
    kill, so a killed rank was named after its peers, and a peer first. A report dated earlier
    (a rank failing on its own, then another crashing) stays first.
    """
    reported = {rank for _, rank, _, _ in reports}
    crashed = [r for r in ranks if r not in reported and (codes[r] or 0) < 0 and -codes[r] in CRASHES]
    lines = {r: f"killed by signal {signal.Signals(-codes[r]).name}" for r in crashed}
    return [(seen[r] - EXIT_NEWS_LAG_S, r, line, line) for r, line in lines.items()]


class _Forward:
    """Passes SIGTERM / SIGINT / SIGUSR1 sent to the launcher on to every rank (they save and stop together),
    instead of dying and leaving the ranks running; its handlers are installed when it is made.

    One that comes while the ranks start (seconds: the fork server imports torch) is passed again
    once all have started (:meth:`again`), so that none of them waits in the rendezvous for a
    rank that never comes.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self, procs: list[BaseProcess]) -> None:
        self.procs = procs
        self.received: list[int] = []
        self.previous = {s: signal.signal(s, self) for s in self.SIGNALS}

    def __call__(self, signum: int, frame: object, record: bool = True) -> None:
        if record:
            self.received.append(signum)
        for p in self.procs:
            if p.is_alive() and p.pid is not None:
                try:
                    os.kill(p.pid, signum)
                except ProcessLookupError:  # it exited (the fork server reaped it) before the launcher heard of it
                    pass

    def again(self) -> None:
        for signum in dict.fromkeys(self.received):
            self(signum, None, record=False)

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def spawn(fn: Callable[..., int | None], world_size: int, *args: Any, timeout_s: float | None = None) -> int:
    """Run ``fn(*args)`` in ``world_size`` new processes; return the first failing rank's exit status (128 + N if
    signal N killed it, as a shell says).

    ``fn`` must be importable (a module-level function). Torch threads are divided
    among the ranks so that N processes do not oversubscribe the cores. With
    ``timeout_s`` the ranks still running then are stopped (status 124).
    """
    held = reserve_port()  # until every rank has exited
    procs, errors = _processes(fn, world_size, held.getsockname()[1], args)
    forward = _Forward(procs)
    watch = _start(procs, forward)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, forward.previous)  # held by `train` until the ranks started
    try:
        worst, first_failed = _wait(procs, watch, forward, timeout_s)
    finally:
        running, killed = _stop(procs, watch, forward, mask)
        held.close()
    reports = _reports(errors)
    return _status(procs, reports, running, killed, worst, first_failed, watch.seen, timeout_s)


def _processes(fn: Callable[..., int | None], world_size: int, port: int, args: tuple) -> tuple[list[BaseProcess], Any]:
    """The ranks' processes, not started, forked from the fork server; and the queue of their failure reports."""
    threads = max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    errors = ctx.Queue()
    parent = _Parent()
    procs = [
        ctx.Process(target=_entry, args=(fn, rank, world_size, port, threads, args, errors, parent), daemon=False)
        for rank in range(world_size)
    ]
    return procs, errors


def _start(procs: list[BaseProcess], forward: _Forward) -> ExitWatch:
    """Start every rank and watch it from then on; a signal that came meanwhile is passed on again."""
    watch = ExitWatch()
    try:
        for p in procs:
            p.start()
            watch.add(p)
    except BaseException:
        watch.close()
        forward.restore()
        raise
    forward.again()
    return watch


def _wait(
    procs: list[BaseProcess], watch: ExitWatch, forward: _Forward, timeout_s: float | None
) -> tuple[int, list[int]]:
    """Wait until every rank exited, one failed or the time limit passed: (the status seen first, the ranks seen
    failed then). After a forwarded signal all may finish: one rank failing then does not stop the others."""
    deadline = time.monotonic() + timeout_s if timeout_s is not None else float("inf")
    while True:
        watch.look()
        done = not any(p.is_alive() for p in procs)  # before `failed`: a rank failing between the two is seen
        failed = [rank for rank, p in enumerate(procs) if p.exitcode not in (None, 0)]
        # After a forwarded signal: let all finish. Under load, every rank may have exited (the killed one,
        # then its peers) before the launcher looks again: their failures are read the same way.
        if failed and not forward.received:
            return procs[failed[0]].exitcode, failed
        if done:
            return 0, []
        if time.monotonic() > deadline:
            return (procs[failed[0]].exitcode, failed) if failed else (124, [])
        time.sleep(POLL_S)


def _stop(
    procs: list[BaseProcess], watch: ExitWatch, forward: _Forward, mask: set[signal.Signals]
) -> tuple[set[int], set[int]]:
    """The launcher's signal handling put back, then the ranks still running stopped: SIGTERM, and SIGKILL for
    one still there 15 s later. Returns (the ranks sent SIGTERM, those killed)."""
    try:
        # Running by both: the watch sees an exit before the fork server tells of it (no signal then to a pid
        # that may soon be another process's), and the fork server answers where the watch has nothing to read.
        running = {rank for rank, p in enumerate(procs) if p.is_alive() and watch.running(rank)}
    finally:
        watch.close()
    forward.restore()
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    for rank in running:
        procs[rank].terminate()
    killed = set()
    for rank, p in enumerate(procs):
        p.join(timeout=15)  # a rank blocked in a collective, or one that traps SIGTERM to save
        if p.is_alive():
            p.kill()
            p.join()
            killed.add(rank)
    return running, killed


def _reports(errors: Any) -> list[tuple[float, int, str, str]]:
    """The failure reports the ranks sent: (time, rank, the full message, its first line)."""
    reports = []
    while True:
        try:
            reports.append(errors.get(timeout=0.2))
        except queue.Empty:
            return reports


def _status(
    procs: list[BaseProcess],
    reports: list[tuple[float, int, str, str]],
    running: set[int],
    killed: set[int],
    worst: int,
    first_failed: list[int],
    seen: list[float],
    timeout_s: float | None,
) -> int:
    """The failures printed (the first failing rank's last) and the launcher's exit status.

    ``worst`` and ``first_failed``: what :func:`_wait` saw first; ``running`` and ``killed``:
    the ranks :func:`_stop` sent SIGTERM and SIGKILL; ``seen``: when each rank was last seen running.
    """
    codes = [p.exitcode for p in procs]
    sent = {rank: -signal.SIGTERM for rank in running} | {rank: -signal.SIGKILL for rank in killed}
    stopped = {rank for rank, code in sent.items() if codes[rank] == code}  # died of what the launcher sent
    # The first failure's suspects: the ranks that poll found failed, and any that died before the launcher
    # signalled them (a late notice of the exit); not one that crashed while the launcher stopped it.
    suspects = sorted(set(first_failed) | ({r for r, c in enumerate(codes) if c} - running)) if first_failed else []
    reports = reports + unreported_kills(suspects, codes, reports, seen)
    why = f" at its {timeout_s:g} s time limit" if worst == 124 else ""
    report_failures(reports, codes, stopped=stopped, why=why, log=lambda line: print(line, file=sys.stderr, flush=True))
    if worst == 0:
        worst = max((shell_status(c) for c in codes if c), default=0)
    elif worst != 124:
        worst = first_failure_status(reports, codes, worst)
    return shell_status(worst)


def shell_status(code: int) -> int:
    """A process's exit code as a shell reports it: 128 + N for one killed by signal N (Python's -N)."""
    return 128 - code if code < 0 else code


def first_failure_status(reports: list[tuple[float, int, str, str]], codes: list[int | None], polled: int) -> int:
    """The exit status of the rank whose report came first (the one named on the last line).

    ``polled`` is the status the wait loop saw first. Ranks that exit within one poll of
    each other (the failing rank, then its peers losing their connection) are seen
    together, in rank order, so that status can be a peer's.
    """
    if reports:
        first = min(reports)[1]
        if codes[first]:
            return codes[first]
    return polled
