"""Typed command-line values: every number and path a sub-command takes is checked as it is parsed.

argparse calls each ``type=`` function on the option's text; an
:class:`argparse.ArgumentTypeError` becomes ``megaformer CMD: error: argument --x: ...``
on one line with status 2 (see :class:`megaformer.cli.Parser`), before any file is read
or any process started. Nothing here writes: the checks only ``stat`` paths and list folders.

Rules: a count or size has its range (``positive_int``, ``nonneg_int``,
``int_range``); a float is finite and in its range (``finite_float``; ``nan`` and
``inf`` parse as floats in Python, so they are refused explicitly); a path that must
exist is a file or a directory as stated (``existing_file``, ``existing_dir``); a path
that will be written is not a directory and its folder exists (``new_file``).
``tests/test_cli_inputs.py`` walks every sub-parser and fails for an int or float
option whose type is not one of these.

Outputs never destroy inputs: once the arguments are parsed, a command checks
its outputs against what it reads with :func:`refuse_output_over_inputs` (an output that
is an input, lies inside an input folder, or holds one) and, before it replaces a folder,
:func:`refuse_to_replace` (never the working directory or a folder above it; ``--force``
replaces an empty folder or one the same command made, never anything else).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from megaformer.errors import ConfigError

Checked = Callable[[str], object]


def _tag(fn: Checked, kind: str) -> Checked:
    """Mark ``fn`` as a checked type (the test that walks the parsers looks for this mark)."""
    fn.checked_kind = kind  # type: ignore[attr-defined]
    return fn


def _parse_int(text: str) -> int:
    try:
        return int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def int_range(lo: int | None = None, hi: int | None = None) -> Checked:
    """An integer in [lo, hi] (either bound may be None)."""

    def parse(text: str) -> int:
        value = _parse_int(text)
        if lo is not None and value < lo:  # the bound that was crossed
            raise argparse.ArgumentTypeError(f"must be at least {lo}, got {value}")
        if hi is not None and value > hi:
            raise argparse.ArgumentTypeError(f"must be at most {hi}, got {value}")
        return value

    parse.__name__ = "integer"  # argparse names the type in "invalid <name> value"
    return _tag(parse, "int")


positive_int = int_range(1)
"""An integer >= 1 (counts, sizes, tensor-parallel degree)."""
nonneg_int = int_range(0)
"""An integer >= 0 (seeds, limits where 0 means "off")."""


def finite_float(
    lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False
) -> Checked:
    """A finite float in the interval from lo to hi; ``lo_open`` / ``hi_open`` exclude the bound."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        low_bad = lo is not None and (value < lo or (lo_open and value == lo))
        high_bad = hi is not None and (value > hi or (hi_open and value == hi))
        if low_bad or high_bad:
            left = "(" if lo_open else "["
            right = ")" if hi_open else "]"
            span = f"{left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{right}"
            raise argparse.ArgumentTypeError(f"must be in {span}, got {value}")
        return value

    parse.__name__ = "number"
    return _tag(parse, "float")


def existing_file(text: str) -> str:
    """A path that is a readable file now ("-" for stdin is accepted)."""
    if text == "-":
        return text
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a directory, expected a file")
    return text


def existing_dir(text: str) -> str:
    """A path that is a directory now."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such directory")
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a file, expected a directory")
    return text


def existing_path(text: str) -> str:
    """A file or a directory that exists now (model file, step directory or run directory)."""
    if not Path(text).exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file or directory")
    return text


def new_file(text: str) -> str:
    """A file to write ("-" for stdout): not a directory, and its folder exists and is writable."""
    if text == "-":
        return text
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a directory, expected a file name")
    folder = path.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: folder {folder} is not writable")
    return text


def new_dir(text: str) -> str:
    """A directory to create or fill: not an existing file; its parent may be created."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a file, expected a directory")
    for parent in path.absolute().parents:  # the first existing ancestor must be a directory
        if parent.exists():
            if not parent.is_dir():
                raise argparse.ArgumentTypeError(f"{text}: {parent} is a file, not a directory")
            break
    return text


# ---- outputs that must not destroy inputs ------------------------------------------------------------


def _resolved(path: str | Path) -> Path:
    return Path(path).expanduser().absolute().resolve()


def overlap(out: str | Path, source: str | Path) -> str | None:
    """How writing ``out`` touches ``source``: "is", "is inside" (a folder ``source``), "holds", or None."""
    o, s = _resolved(out), _resolved(source)
    if o == s or (o.exists() and s.exists() and os.path.samefile(o, s)):  # a hard link or a bind mount too
        return "is"
    if s in o.parents:
        return "is inside"
    if o in s.parents:
        return "holds"
    return None


def refuse_output_over_inputs(
    option: str, out: str | Path, inputs: Iterable[tuple[str, str | Path | None]], what: str
) -> None:
    """ConfigError when ``out`` is one of ``inputs``, lies inside one, or holds one.

    ``inputs`` are (name, path) pairs, e.g. ("--ref file", args.ref); None and "-"
    (stdin, stdout) are skipped, and so is an ``out`` of None or "-". ``what`` names the
    output in the advice ("hypotheses").
    """
    if out is None or str(out) == "-":
        return
    for name, source in inputs:
        if source is None or str(source) == "-":
            continue
        relation = overlap(out, source)
        if relation is not None:
            raise ConfigError(
                f"{option} {out} would overwrite the input: it {relation} the {name} {source}; "
                f"write the {what} elsewhere"
            )


def refuse_checkpoint_names(option: str, out: str | Path) -> None:
    """ConfigError for an output named like a step directory or a pointer (``latest``, ``best``) beside a run's
    ``step-*`` folders: training's saves and pruning own those names (an export named ``step-00000300`` there was
    replaced by the run's step 300)."""
    from megaformer.checkpoint.format import POINTERS, STEP_DIR

    path = _resolved(out)
    if (STEP_DIR.match(path.name) or path.name in POINTERS) and any(p.is_dir() for p in path.parent.glob("step-*")):
        raise ConfigError(
            f"{option} {out}: {path.parent} holds a run's checkpoints, and {path.name!r} is a name training's saves "
            f"and pruning give and replace there: write it elsewhere or under another name"
        )


def refuse_to_replace(
    option: str,
    out: str | Path,
    force: bool,
    made_here: Callable[[Path], bool],
    marker: str,
    foreign: Callable[[Path], list[str]] = lambda path: [],
) -> None:
    """ConfigError unless the existing ``out`` may be replaced by this command.

    Never the working directory or a folder above it (whatever ``force`` says). An
    existing non-empty ``out`` needs ``force``, and even then only an empty folder or
    something this command made before (``made_here``; ``marker`` says what it lacks
    otherwise, e.g. "no manifest.json") is replaced, and only while it holds nothing else
    (``foreign``: the names in it the command did not write): a folder of someone's own
    files is never emptied.
    """
    path, cwd = _resolved(out), Path.cwd().resolve()
    if path == cwd or path in cwd.parents:
        where = "the working directory" if path == cwd else f"a folder above the working directory {cwd}"
        raise ConfigError(f"{option} {out}: is {where}, which is never replaced: name a new folder or file instead")
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return
    if not force:
        raise ConfigError(f"{option} {out}: already exists; choose another {option} or pass --force to replace it")
    if not made_here(path):
        kind = "a folder" if path.is_dir() else "a file"
        raise ConfigError(
            f"{option} {out}: {kind} that this command did not write ({marker}), and --force replaces only "
            f"its own earlier output or an empty folder: choose another {option} or remove it yourself"
        )
    if extra := foreign(path):
        named = ", ".join(extra[:3]) + (f" and {len(extra) - 3} more" if len(extra) > 3 else "")
        raise ConfigError(
            f"{option} {out}: also holds {named}, which this command did not write and --force would delete: "
            f"move {'it' if len(extra) == 1 else 'them'} elsewhere or choose another {option}"
        )


for _fn, _kind in (
    (existing_file, "path"),
    (existing_dir, "path"),
    (existing_path, "path"),
    (new_file, "path"),
    (new_dir, "path"),
):
    _tag(_fn, _kind)
