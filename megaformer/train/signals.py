"""Preemption, time limit and cancel, told apart.

| signal | sent by | the trainer |
| --- | --- | --- |
| ``SIGUSR1`` | SLURM, ``--signal=B:USR1@180`` (forwarded by the batch script): the time limit or a preemption is near | saves a checkpoint, requeues the job once (``scontrol requeue $SLURM_JOB_ID``), exits 0 |
| ``SIGTERM`` | ``scancel``, the time limit without a warning, a node going down | saves if it can, does not requeue, exits 143 |

A job that received the warning before finishing a single step does not requeue (it
would only loop: the time limit is too short to make progress), and a job is requeued
at most once per run of the script.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

NONE, REQUEUE, TERMINATE = 0, 1, 2
EXIT_TERMINATED = 128 + signal.SIGTERM


class SignalWatch:
    """Records USR1/TERM in the handler; :meth:`poll` agrees on them across ranks between steps."""

    def __init__(self) -> None:
        self.received = NONE
        self.requeued = False
        self._previous = {}
        for sig, what in ((signal.SIGUSR1, REQUEUE), (signal.SIGTERM, TERMINATE)):
            self._previous[sig] = signal.signal(sig, lambda *_, w=what: self._note(w))

    def _note(self, what: int) -> None:
        self.received = max(self.received, what)  # TERM wins over USR1

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def requeue(made_progress: bool, log=print) -> bool:
    """Ask SLURM to requeue this job; True if it accepted."""
    job = os.environ.get("SLURM_JOB_ID")
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
    proc = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True)
    if proc.returncode != 0:
        log(f"signal: scontrol requeue {job} failed: {proc.stderr.strip() or proc.returncode}")
        return False
    log(f"signal: job {job} requeued")
    sys.stdout.flush()
    return True
