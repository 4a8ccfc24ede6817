"""One writer per run directory: ``RUN/.lock``, held by the training that writes there.

The lock is an ``flock`` on ``RUN/.lock``, taken before anything else is written into
the run directory and held until the command ends. The kernel releases it when the
holder's process dies, however it dies (kill -9 included), so a lock is never left
behind by a crash. The file also records who holds it (host, pid, SLURM job id, start
time), for the message that refuses a second writer and for the line that says a lock
is taken over from a holder that is gone.

A second ``train`` on a held run directory is refused in one line naming the holder.
A requeued SLURM job (same job id) waits a short while for its own earlier incarnation
to let go, then takes the lock over. On a file system without ``flock`` (some NFS and
Lustre mounts), the recorded holder is all there is: a holder on this host that no
longer runs, or one of the same SLURM job, is taken over; any other is refused.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from megaformer.errors import ConfigError
from megaformer.files import path_refusal

LOG = logging.getLogger(__name__)

LOCK_NAME = ".lock"
REQUEUE_WAIT_S = 60.0  # how long a requeued job waits for its earlier incarnation's lock
# How long a lock held with an empty record is taken for one changing hands (its holder between locking and
# writing the record, or between clearing it and unlocking: microseconds, unless the machine is loaded).
CHANGING_HANDS_S = 2.0


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a run directory's lock."""

    host: str
    pid: int
    slurm_job_id: str | None
    started: float

    @staticmethod
    def this_process(slurm_job_id: str | None) -> Holder:
        return Holder(socket.gethostname(), os.getpid(), slurm_job_id or None, time.time())

    def describe(self) -> str:
        job = f", SLURM job {self.slurm_job_id}" if self.slurm_job_id else ""
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on {self.host}{job}, since {since}"

    def is_alive_here(self) -> bool:
        """Whether this holder is a process that still runs on this host (False for other hosts)."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True  # a process of another user
        return True


def read_holder(path: Path) -> Holder | None:
    """The holder recorded in a lock file, or None if there is none (or it is unreadable)."""
    try:
        fields = json.loads(path.read_text())
        return Holder(str(fields["host"]), int(fields["pid"]), fields.get("slurm_job_id"), float(fields["started"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


class RunLock:
    """The run directory's lock; :meth:`acquire` takes it or raises ConfigError naming the holder."""

    def __init__(self, run_dir: Path, slurm_job_id: str | None, log: Callable[[str], None] | None = None) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.me = Holder.this_process(slurm_job_id)
        self.log = log or LOG.info
        self._fd: int | None = None

    def _refused(self, err: OSError, path: Path | None = None) -> ConfigError:
        """The file system's refusal of the run directory or its lock, in one line (its true cause)."""
        return ConfigError(f"--run-dir {self.path.parent}: {path_refusal(path or self.path, err)}")

    def _open(self, flags: int) -> int:
        """The lock file, opened as :meth:`acquire` opens it; a refusal (a directory there, a loop, ...) is one line."""
        if os.path.isdir(self.path):  # O_RDONLY opens a directory: say so for a check as for the training
            raise self._refused(OSError(errno.EISDIR, "Is a directory"))
        try:
            return os.open(self.path, flags, 0o644)
        except OSError as err:
            raise self._refused(err) from None

    def acquire(self, requeue_wait_s: float = REQUEUE_WAIT_S) -> RunLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise self._refused(err, self.path.parent) from None
        fd = self._open(os.O_RDWR | os.O_CREAT)
        try:
            locked = self._flock(fd, requeue_wait_s)
            previous = read_holder(self.path)
            if not locked:
                self._refuse_unless_gone(previous)
            elif previous is not None and previous.pid != self.me.pid:
                self.log(f"train: took over the run directory's lock from {previous.describe()} (no longer running)")
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(asdict(self.me)) + "\n").encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def _flock(self, fd: int, requeue_wait_s: float) -> bool:
        """True once flock is held; False where the file system has no flock. Refuses a live holder."""
        deadline = time.monotonic() + requeue_wait_s
        # A held lock whose file names nobody is changing hands: the holder is writing its record
        # (acquire) or has just cleared it (release, before unlocking). Look again for a moment from
        # when it was first seen so: a requeued job's earlier self may clear it seconds into the wait.
        empty_since = None
        looked_again = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError as err:
                if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    self.log(f"train: {self.path}: this file system has no flock; relying on the recorded holder")
                    return False
                if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise ConfigError(f"{self.path}: cannot lock the run directory ({err.strerror})") from None
            holder = read_holder(self.path)
            if holder is not None:
                empty_since = None
            elif empty_since is None or time.monotonic() < empty_since + CHANGING_HANDS_S:
                empty_since = empty_since or time.monotonic()
                time.sleep(0.02)
                continue
            same_job = holder is not None and self.me.slurm_job_id and holder.slurm_job_id == self.me.slurm_job_id
            if (not same_job and looked_again) or time.monotonic() >= deadline:
                raise ConfigError(self._held_message(holder))
            # Our own job's earlier incarnation (requeued) is still letting go; another holder is looked
            # at once more, 0.1 s on: a `train --check` of another job holds the flock for an instant.
            time.sleep(0.5 if same_job else 0.1)
            looked_again = not same_job

    def check_free(self) -> None:
        """Refuse, as :meth:`acquire` would, a run directory another training holds; take and write nothing.

        For a check before any rank starts (``megaformer train --check``). A holder of this
        SLURM job (a requeued job's earlier attempt, still ending) is let be: the ranks wait
        for it and take the lock over. A record left by a holder that is gone says nothing
        while nobody holds the flock; without flock, the record is all there is.
        """
        if not os.path.lexists(self.path):
            return
        fd = self._open(os.O_RDWR)  # as acquire opens it: a directory, a link loop or a read-only file is refused
        holder = read_holder(self.path)
        if holder is None or (self.me.slurm_job_id and holder.slurm_job_id == self.me.slurm_job_id):
            os.close(fd)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # shared, for an instant: a writer's would fail
        except OSError as err:
            if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                self._refuse_unless_gone(holder, log=lambda line: None)
                return
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ConfigError(self._held_message(holder)) from None
            raise ConfigError(f"{self.path}: cannot lock the run directory ({err.strerror})") from None
        finally:
            os.close(fd)

    def _refuse_unless_gone(self, holder: Holder | None, log: Callable[[str], None] | None = None) -> None:
        """Without flock: take over only a holder that is gone from this host, or one of our own SLURM job."""
        log = log or self.log
        if holder is None or holder.pid == self.me.pid:
            return
        if self.me.slurm_job_id and holder.slurm_job_id == self.me.slurm_job_id:
            log(f"train: took over the run directory's lock from {holder.describe()} (the same SLURM job)")
            return
        if holder.host == self.me.host and not holder.is_alive_here():
            log(f"train: took over the run directory's lock from {holder.describe()} (no longer running)")
            return
        raise ConfigError(self._held_message(holder))

    def _held_message(self, holder: Holder | None) -> str:
        who = holder.describe() if holder is not None else "another process"
        return (
            f"--run-dir {self.path.parent}: another training writes there ({who}); "
            f"wait for it to end, or give this run another --run-dir"
        )

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)  # nobody holds it now
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        except OSError:
            pass  # the kernel releases the lock with the file anyway
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire() if self._fd is None else self

    def __exit__(self, *exc: object) -> None:
        self.release()
