"""torchrun as ``slurm/common.sh`` runs it (``LAUNCHER=torchrun``): torch's own, stopped by a signal without a traceback.

torchrun handles the signals it is given (``--signals-to-handle``) by passing them to its ranks,
waiting for them to stop, and raising ``SignalException`` out of its ``main``: every requeue
and every ``scancel`` of a job ended with a Python traceback in the job's output and status 1,
as if it had crashed. Here that exception is the stop it is: one line naming the signal that
stopped torchrun first (SLURM's SIGTERM for a requeued attempt often comes during the shutdown
the warning began) and status 128 + its number, as a shell reports a process a signal ended.
Whether the job goes on is SLURM's requeue, which ``slurm/common.sh`` asks SLURM about.

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
        first = stop
        while isinstance(first.__context__, SignalException):  # raised while handling an earlier one
            first = first.__context__
        name = signal.Signals(first.sigval).name
        print(f"torchrun: stopped by {name}, passed on to the ranks: exit {128 + first.sigval}", file=sys.stderr)
        return 128 + first.sigval
    return 0


if __name__ == "__main__":
    sys.exit(main())
