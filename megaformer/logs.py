"""Messages through :mod:`logging`: one hierarchy, ``megaformer.*``, configured once per process.

Library modules log to ``logging.getLogger(__name__)`` and never print. :func:`configure`, called
by the CLI (and, through the environment it sets, by every rank a launcher starts), gives the
``megaformer`` logger a console handler that writes each message alone, in the format users
already read (a step's progress line, ``checkpoint: saved ...``): information to standard
output, warnings and errors to standard error, and so are messages logged with
``extra=STDERR`` (progress while a translation is written to standard output;
``PROGRESS_ON_A_TERMINAL`` ends a line with a carriage return, for the next to overwrite). ``-q`` keeps
warnings and errors only, ``-v`` adds debug messages. Ranks other than 0 show warnings and
errors only (:func:`set_rank`); every rank of a training run also writes all it logs, with
time and level, to its own file in the run directory (:func:`log_to_file`: ``logs/rank-N.log``).

A library keeps quiet unless configured: nothing is shown when megaformer is imported by
another program that has not set up ``logging`` itself, beyond Python's last-resort handler
for warnings and errors.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

ROOT = "megaformer"
LEVEL_ENV = "MEGAFORMER_LOG_LEVEL"  # the console level the CLI chose, for the ranks it starts
STDERR = {"stderr": True}  # extra= of a message for standard error whatever its level
PROGRESS_ON_A_TERMINAL = {"stderr": True, "end": "\r"}  # extra= of a line the next one overwrites
_FILE_FORMAT = "%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s"


class Console(logging.Handler):
    """Each message alone: to standard error from warnings up or when marked :data:`STDERR`, else standard output.

    The streams are looked up at each message (``sys.stdout`` as it is then), so a test's or a
    caller's replacement of them is honoured.
    """

    def emit(self, record: logging.LogRecord) -> None:
        to_stderr = record.levelno >= logging.WARNING or getattr(record, "stderr", False)
        stream = sys.stderr if to_stderr else sys.stdout
        try:
            stream.write(self.format(record) + getattr(record, "end", "\n"))
            stream.flush()
        except BrokenPipeError:  # the reader went away (`| head`): the CLI ends quietly, status 141
            raise
        except Exception:  # noqa: BLE001 (logging's own contract: a handler never raises)
            self.handleError(record)


def level_from(quiet: bool, verbose: bool) -> int:
    """``-q``: warnings and errors; ``-v``: debug messages too; neither: information."""
    return logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO


def _console(logger: logging.Logger) -> Console | None:
    return next((h for h in logger.handlers if isinstance(h, Console)), None)


def configure(level: int | None = None, environ: dict[str, str] = os.environ) -> int:
    """Give the ``megaformer`` logger its console at ``level`` (None: the level in the environment, else
    information) and record the level in the environment for processes started from this one."""
    if level is None:
        text = environ.get(LEVEL_ENV, "")
        level = int(text) if text.isdigit() else logging.INFO
    environ[LEVEL_ENV] = str(level)
    logger = logging.getLogger(ROOT)
    console = _console(logger) or Console()
    console.setLevel(level)
    if console not in logger.handlers:
        logger.addHandler(console)
    logger.setLevel(min(level, logging.INFO))  # a rank's file keeps information even under -q
    logger.propagate = False
    return level


def set_rank(rank: int) -> None:
    """Ranks other than 0 show only warnings and errors on the console (their files keep everything)."""
    console = _console(logging.getLogger(ROOT))
    if console is not None and rank != 0:
        console.setLevel(max(console.level, logging.WARNING))


def log_to_file(path: str | Path, rank: int) -> Path:
    """Append everything this process logs, with time, rank and level, to ``path`` (its folder made)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger(ROOT)
    for handler in [h for h in logger.handlers if isinstance(h, logging.FileHandler)]:
        logger.removeHandler(handler)
        handler.close()
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(_FILE_FORMAT.format(rank=rank)))
    handler.setLevel(min(logger.level or logging.INFO, logging.INFO))
    logger.addHandler(handler)
    return path
