"""torchrun as ``slurm/common.sh`` runs it (``LAUNCHER=torchrun``): torch's own, ending on a signal or a failed rank without a traceback.

torchrun handles the signals it is given (``--signals-to-handle``) by passing them to its ranks,
waiting for them to stop, and raising ``SignalException`` out of its ``main``: every requeue
and every ``scancel`` of a job ended with a Python traceback in the job's output and status 1,
as if it had crashed. Here that exception is the stop it is: one line naming the signal that
stopped torchrun first (SLURM's SIGTERM for a requeued attempt often comes during the shutdown
the warning began) and status 128 + its number, as a shell reports a process a signal ended.
Whether the job goes on is SLURM's requeue, which ``slurm/common.sh`` asks SLURM about.

A rank that fails (a one-line error of its own, or a signal) made torchrun raise
``ChildFailedError``: a traceback through torch's launcher and a table of every rank's
failure, and status 1 whatever the rank's status was. Here it is one line after the rank's
own message, naming the rank that failed first (torchrun stops the others), and that rank's status
(128 + the signal's number for a signal), as ``srun`` and ``megaformer train --nproc`` end.

Run as ``python -m launcher.torchrun`` with torchrun's own arguments.
"""

from __future__ import annotations

import signal
import socket
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except SignalException as stop:
        first = stop
        while isinstance(first.__context__, SignalException):  # raised while handling an earlier one
            first = first.__context__
        name = signal.Signals(first.sigval).name
        print(f"torchrun: stopped by {name}, passed on to the ranks: exit {128 + first.sigval}", file=sys.stderr)
        return 128 + first.sigval
    except ChildFailedError as failed:
        line, status = failure_line(failed)
        print(line, file=sys.stderr)
        return status
    return 0


def failure_line(failed: ChildFailedError) -> tuple[str, int]:
    """One line for torchrun's ``ChildFailedError`` and the exit status it stands for: the first rank's."""
    rank, first = failed.get_first_failure()
    if first.exitcode < 0:
        how, status = f"killed by {signal.Signals(-first.exitcode).name}", 128 - first.exitcode
    else:
        how, status = f"exit {first.exitcode}", first.exitcode
    where = f"rank {rank} (local rank {first.local_rank} on {socket.gethostname()})"
    return f"torchrun: {where} failed first ({how}); its message, if any, is above: exit {status}", status


if __name__ == "__main__":
    sys.exit(main())
