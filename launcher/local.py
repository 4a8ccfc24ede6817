"""Start N local processes (gloo on a CPU), one per rank, and wait for all of them.

Used when a multi-rank command (``megaformer parity``, ``megaformer train --nproc N``,
the tests) runs outside any launcher. Each child gets the variables torchrun would
set (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). If one rank fails, the
others are stopped instead of waiting forever in a collective.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable[..., int | None], rank: int, world_size: int, port: int, threads: int, args: tuple) -> None:
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

    try:
        code = fn(*args)
    except MegaformerError as err:
        print(f"rank {rank}: error: {err}", file=sys.stderr)
        code = 2
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))


def spawn(fn: Callable[..., int | None], world_size: int, *args: Any, timeout_s: float | None = None) -> int:
    """Run ``fn(*args)`` in ``world_size`` fresh processes; return the worst exit status.

    ``fn`` must be importable (a module-level function). Torch threads are divided
    among the ranks so that N processes do not oversubscribe the cores. With
    ``timeout_s`` the ranks still running then are stopped (status 124).
    """
    threads = max(1, (os.cpu_count() or 1) // world_size)
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_entry, args=(fn, rank, world_size, port, threads, args), daemon=False)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    # Pass SIGTERM / SIGINT / SIGUSR1 sent to this launcher on to every rank (they save and
    # stop together), instead of dying and leaving the ranks running.
    forwarded = []

    def forward(signum, frame):
        forwarded.append(signum)
        for p in procs:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    deadline = time.monotonic() + timeout_s if timeout_s is not None else float("inf")
    worst = 0
    try:
        while any(p.is_alive() for p in procs):
            failed = [p for p in procs if p.exitcode not in (None, 0)]
            if (failed and not forwarded) or time.monotonic() > deadline:  # after a forwarded signal: let all finish
                worst = failed[0].exitcode if failed else 124
                break
            time.sleep(0.05)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=15)  # a rank blocked in a collective, or one that traps SIGTERM to save
            if p.is_alive():
                p.kill()
                p.join()
    codes = [p.exitcode for p in procs]
    if worst == 0:
        worst = max((abs(c) for c in codes if c), default=0)
    return worst
