"""Preemption, time limit and cancel, told apart.

| signal | sent by | the trainer |
| --- | --- | --- |
| ``SIGUSR1`` | SLURM, ``--signal=B:USR1@180`` (forwarded by the batch script): the time limit or a preemption is near | saves a checkpoint, requeues the job once (``scontrol requeue $SLURM_JOB_ID``), exits 0 |
| ``SIGTERM`` | ``scancel``, the time limit without a warning, a node going down | saves if it can, does not requeue, exits 143; during start-up, until the loop begins, a rank stops at once (143) |
| ``SIGINT`` | Ctrl-C in the terminal (the whole process group: launcher, ranks, loader workers), once training runs | as ``SIGTERM``, exits 130; before the first step, a rank stops at once (130) |

| parent death | the launcher (torchrun, ``megaformer train --nproc``, slurmstepd) died, e.g. torchrun killed by a USR1 it does not handle | treated as ``SIGTERM``: saves if the peers can still agree, exits 143; a watchdog ends the process ``parent_grace_s`` later whatever it is doing |

A warning is taken at the end of a step: a job warned during its start-up trains one step,
saves it and requeues, so that every attempt makes progress; a job is requeued at most
once per run of the script.

Ranks never outlive their launcher: torchrun starts each rank in a session of its own, so
a signal that kills torchrun does not reach them, and a rank blocked in a collective runs
no Python signal handler. A daemon thread therefore checks every ``poll_s`` that the
launcher lives: for a rank of ``megaformer train --nproc`` (:mod:`launcher.local`, which
forks it from multiprocessing's fork server, not from itself) multiprocessing's own
handle on the process that started it; otherwise ``os.getppid()`` against the parent seen
at start-up (a dead parent re-parents the rank). It does not need the main thread, so it
also ends a rank stuck in a collective after the grace time.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import threading

LOG = logging.getLogger(__name__)

NONE, REQUEUE, TERMINATE = 0, 1, 2
EXIT_TERMINATED = 128 + signal.SIGTERM
EXIT_INTERRUPTED = 128 + signal.SIGINT


HELD = {signal.SIGUSR1}


def hold_signals() -> set[signal.Signals]:
    """Block USR1 from start-up until :class:`SignalWatch` handles it; returns the mask before.

    A warning that arrives while a rank is still importing or building its engine would
    otherwise kill it (USR1's default action). Blocked, it stays pending and reaches the
    handler the moment the watch starts: the rank trains a step, saves and requeues.
    The mask is inherited by processes started meanwhile (local ranks unblock in their watch).

    TERM is not held: before the first step a rank has trained nothing to save, and one
    waiting in the rendezvous for a peer that failed (a run directory another job holds,
    a bad config) could not act on it anyway; it would wait for SLURM's SIGKILL, KillWait
    seconds later, and the job would end 137 instead of with the first failure's status.
    """
    return signal.pthread_sigmask(signal.SIG_BLOCK, HELD)


class Launcher:
    """The process that started this rank, as seen at start-up."""

    def __init__(self) -> None:
        self._started_by = multiprocessing.parent_process()  # launcher.local's ranks: also through the fork server
        self._parent = os.getppid()
        self.pid = self._started_by.pid if self._started_by is not None else self._parent

    def alive(self) -> bool:
        if self._started_by is not None:
            return self._started_by.is_alive()  # its end of a pipe to this process is open
        return os.getppid() == self._parent


class SignalWatch:
    """Records USR1/TERM in the handler (and the launcher's death in a watchdog thread);
    the trainer agrees on :attr:`received` across ranks between steps."""

    def __init__(self, slurm_job: str | None = None, parent_grace_s: float = 120.0, poll_s: float = 0.5) -> None:
        self.slurm_job = slurm_job  # the SLURM job this rank runs in (launcher.env.slurm_job), or None
        self.received = NONE
        self.requeued = False  # stopping after a warning in a SLURM job: the job is (or may be) requeued
        self.stopped_by = "SIGTERM"  # what TERMINATE came from, for the log and the exit status
        self._previous = {}
        for sig, what in ((signal.SIGUSR1, REQUEUE), (signal.SIGTERM, TERMINATE), (signal.SIGINT, TERMINATE)):
            self._previous[sig] = signal.signal(sig, lambda signum, _, w=what: self._note(w, signum))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD)  # a warning held since start-up arrives now
        self._stop = threading.Event()
        self._watchdog = threading.Thread(
            target=self._watch_parent, args=(Launcher(), parent_grace_s, poll_s), name="parent-watchdog", daemon=True
        )
        self._watchdog.start()

    def _note(self, what: int, signum: int | None = None) -> None:
        if signum == signal.SIGINT and self.received != TERMINATE:
            self.stopped_by = "SIGINT"
        self.received = max(self.received, what)  # TERM (or INT) wins over USR1

    def note_requeue(self) -> None:
        """This rank stops after a warning: in a SLURM job, the requeue's SIGTERM is coming (see :meth:`restore`).
        Rank 0's requeue may have been declined (no step trained): SLURM's SIGKILL then ends a rank that hangs."""
        self.requeued = self.slurm_job is not None

    @property
    def exit_status(self) -> int:
        """The status of a run stopped by TERMINATE: 130 after Ctrl-C, 143 otherwise (the shells' 128 + signal)."""
        return EXIT_INTERRUPTED if self.stopped_by == "SIGINT" else EXIT_TERMINATED

    def _watch_parent(self, launcher: Launcher, grace_s: float, poll_s: float) -> None:
        """Turn the launcher's death into TERMINATE, then end the process after ``grace_s``."""
        while not self._stop.wait(poll_s):
            if not launcher.alive():
                LOG.warning(
                    f"signal: launcher (pid {launcher.pid}) is gone: saving and stopping (exit within {grace_s:.0f} s)"
                )
                self._note(TERMINATE)
                if not self._stop.wait(grace_s):
                    LOG.error("signal: launcher gone and the rank did not stop in time: exiting")
                    sys.stderr.flush()
                    os._exit(EXIT_TERMINATED)
                return

    def restore(self) -> None:
        """Put back the handlers found; after a requeue (:attr:`requeued`) SIGTERM stays ignored.

        SLURM ends a requeued attempt with SIGTERM while its ranks close their loaders, logs,
        process groups and the run directory's lock: killed there, a rank would leave the lock to
        be taken over and srun would report it "Terminated". The process is ending, so TERM stays
        ignored to its end (:func:`megaformer.train.launch.launch_scope`); SLURM's SIGKILL still ends
        a rank that hangs.
        """
        self._stop.set()
        for sig, previous in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if self.requeued and sig == signal.SIGTERM else previous)


def _ignore_term_and_usr1() -> None:
    """In scontrol's process, before it starts: the requeue's SIGTERM and a repeated warning leave it be."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def requeue(job: str | None, made_progress: bool, log=None) -> bool:
    """Ask SLURM to requeue ``job`` (this process's, None outside SLURM); True if it accepted."""
    log = log or LOG.info
    if job is None:
        log("signal: USR1 outside a SLURM job: checkpoint saved, nothing to requeue")
        return False
    if not made_progress:
        log("signal: USR1 before any step was trained: not requeueing (it would loop); raise the time limit")
        return False
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        log("signal: scontrol not found on PATH: cannot requeue")
        return False
    # An accepted requeue makes SLURM end the job's processes at once with SIGTERM, scontrol
    # included: it ignores TERM so that it can report the answer (SIGKILL comes only after KillWait).
    # It ignores USR1 too: the batch shell repeats the warning every 5 s to every process of the step
    # (slurm/common.sh), and one that came while scontrol ran killed it, the requeue unanswered.
    proc = subprocess.run(
        [scontrol, "requeue", job],
        capture_output=True,
        text=True,
        preexec_fn=_ignore_term_and_usr1,
    )
    if proc.returncode != 0:
        log(f"signal: scontrol requeue {job} failed: {proc.stderr.strip() or proc.returncode}")
        return False
    log(f"signal: job {job} requeued")
    sys.stdout.flush()
    return True
