"""Messages through ``logging`` (megaformer/logs.py): where each goes, -q and -v, ranks, per-rank files."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megaformer import logs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def logger():
    """The megaformer logger as this process had it, put back after the test."""
    root = logging.getLogger(logs.ROOT)
    saved = (list(root.handlers), root.level, root.propagate, os.environ.get(logs.LEVEL_ENV))
    levels = [h.level for h in saved[0]]
    yield logging.getLogger("megaformer.test")
    for handler in root.handlers:
        if handler not in saved[0]:
            handler.close()
    root.handlers[:], root.level, root.propagate = saved[0], saved[1], saved[2]
    for handler, level in zip(saved[0], levels):
        handler.setLevel(level)
    if saved[3] is None:
        os.environ.pop(logs.LEVEL_ENV, None)
    else:
        os.environ[logs.LEVEL_ENV] = saved[3]


def test_information_to_stdout_warnings_and_marked_messages_to_stderr(logger, capsys):
    logs.configure(logging.INFO)
    logger.info("step 1 | loss 2.0")
    logger.info("translated 5/9 sentences", extra=logs.STDERR)
    logger.warning("train: tensorboard disabled")
    logger.debug("not shown")
    out, err = capsys.readouterr()
    assert out == "step 1 | loss 2.0\n"  # the line alone, as users read it
    assert err == "translated 5/9 sentences\ntrain: tensorboard disabled\n"
    logger.info("translated 6/9 sentences", extra=logs.PROGRESS_ON_A_TERMINAL)
    assert capsys.readouterr().err == "translated 6/9 sentences\r"


def test_quiet_keeps_warnings_verbose_adds_debug_and_the_level_passes_to_started_processes(logger, capsys):
    assert logs.configure(logs.level_from(quiet=True, verbose=False)) == logging.WARNING
    assert os.environ[logs.LEVEL_ENV] == str(logging.WARNING)
    logger.info("hidden")
    logger.error("shown")
    assert capsys.readouterr() == ("", "shown\n")
    assert logs.configure() == logging.WARNING  # a rank reads the CLI's level from its environment
    logs.configure(logs.level_from(quiet=False, verbose=True))
    logger.debug("a debug line")
    assert capsys.readouterr().out == "a debug line\n"


def test_other_ranks_show_warnings_only_and_every_rank_keeps_its_file(logger, capsys, tmp_path):
    logs.configure(logging.INFO)
    logs.set_rank(1)
    path = logs.log_to_file(tmp_path / "logs" / "rank-1.log", 1)
    logger.info("checkpoint: saved step-10")
    logger.warning("signal: launcher gone")
    assert capsys.readouterr() == ("", "signal: launcher gone\n")
    lines = path.read_text().splitlines()
    assert re.fullmatch(r"\S+ \S+ rank 1 INFO megaformer\.test: checkpoint: saved step-10", lines[0]), lines
    assert "WARNING" in lines[1]


def test_library_modules_never_print():
    """Only the commands and the CLI write output; the library logs (a user can quiet it, or route it)."""
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "megaformer").rglob("*.py"))
        if path.parent.name != "commands" and path.name != "cli.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "print(" in line
    ]
    assert not found, found


def test_train_quiet_prints_only_warnings_and_errors_and_each_rank_writes_its_log(tmp_path):
    data, run = tmp_path / "data", tmp_path / "run"
    cli = [sys.executable, "-m", "megaformer.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    prep = subprocess.run([*cli, "prepare", "--synthetic", "200", "--out", str(data), "-q"], capture_output=True)
    assert prep.returncode == 0 and prep.stdout == prep.stderr == b"", prep.stderr
    sets = ["data.max_tokens=512", "train.tokens_per_step=1024", "train.max_steps=4", "train.log_interval=1"]
    sets += ["train.save_interval=2", "train.eval_interval=0", "train.peak_tflops=0.1", f"data.path={data}"]
    train = [*cli, "train", "--config", "configs/tiny.yaml", "--nproc", "2", "--run-dir", str(run)]
    train += [arg for s in sets for arg in ("--set", s)]
    quiet = subprocess.run([*train, "-q"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0, quiet.stderr
    # Only warnings: megaformer's ("warning: ...") and torch's C++ ones ("[W...]", e.g. c10d retrying a connection
    # on a loaded machine), which no -q of ours governs.
    assert quiet.stdout == "" and all(line.startswith(("warning:", "[W")) for line in quiet.stderr.splitlines()), quiet
    rank0, rank1 = (run / "logs" / f"rank-{r}.log" for r in (0, 1))
    assert re.search(r"rank 0 INFO megaformer\.train\.metrics: step +4/4 \| loss", rank0.read_text())
    assert "rank 1 INFO" in rank1.read_text()
    said = subprocess.run([*train, "--set", "train.max_steps=6"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert said.returncode == 0, said.stderr
    assert re.search(r"^step +6/6 \| loss", said.stdout, re.M) and "checkpoint: saved" in said.stdout, said.stdout
    assert "train: resumed from" in said.stdout
