"""What both peers' drivers share: the environment their commands run in, and running one with its output logged."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

# One process of as many threads as cores (megaformer's recipe runs as many processes of one thread). fairseq 0.12
# and OpenNMT-py 3.5 pickle config objects into their checkpoints, which torch >= 2.6 refuses to load by default;
# the files they load here are the ones this run's own training wrote.
ENV = {"OMP_NUM_THREADS": str(os.cpu_count() or 1), "PYTHONWARNINGS": "ignore", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}


def run_logged(argv: list[str], log: Path, what: str, stdout: Path | None = None) -> None:
    """Run ``argv``, output appended to ``log`` (stdout to ``stdout`` if given); on failure exit with the log's tail."""
    with open(log, "a", encoding="utf-8") as err, open(stdout or os.devnull, "w", encoding="utf-8") as out:
        proc = subprocess.run(argv, stdout=out if stdout else err, stderr=err, env={**os.environ, **ENV})
    if proc.returncode:
        tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-5:]
        raise SystemExit(f"{what} failed with status {proc.returncode} ({log}):\n" + "\n".join(tail))
