"""torchrun as ``slurm/common.sh`` runs it (``LAUNCHER=torchrun``): torch's own, stopped by a signal without a traceback.

torchrun handles the signals it is given (``--signals-to-handle``) by passing them to its ranks,
waiting for them to stop, and raising ``SignalException`` out of its ``main``: every requeue
and every ``scancel`` of a job ended with a Python traceback in the job's output and status 1,
as if it had crashed. Here that exception is the stop it is. After SIGUSR1 (the time-limit
warning: the ranks saved and requeued the job) the status is 0; after any other signal it is
128 + the signal's number, as a shell reports a process the signal ended.

Run as ``python -m launcher.torchrun`` with torchrun's own arguments.
"""

from __future__ import annotations

import signal
import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except SignalException as stop:
        name = signal.Signals(stop.sigval).name
        status = 0 if stop.sigval == signal.SIGUSR1 else 128 + stop.sigval
        print(f"torchrun: stopped by {name}, passed on to the ranks: exit {status}", file=sys.stderr, flush=True)
        return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
