"""Typed command-line values: every number and path a sub-command takes is checked as it is parsed.

argparse calls each ``type=`` function on the option's text; an
:class:`argparse.ArgumentTypeError` becomes ``megaformer CMD: error: argument --x: ...``
on one line with status 2 (see :class:`megaformer.cli.Parser`), before any file is read
or any process started. Nothing here writes: the checks ``stat`` paths, open or list inputs once, and make and
remove a probe file where an output goes (so the file system itself says whether it takes new files). Every
refusal of the file system names the path and its true cause (:func:`megaformer.files.path_refusal`).

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
import errno
import math
import os
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

from megaformer.errors import ConfigError, interval
from megaformer.files import name_max, path_refusal

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
            raise argparse.ArgumentTypeError(f"must be in {interval(lo, hi, lo_open, hi_open)}, got {text}")
        return value

    parse.__name__ = "number"
    return _tag(parse, "float")


def _stat(text: str | Path) -> os.stat_result | None:
    """``text``'s status (links followed), None where nothing is there; any other refusal in one line."""
    try:
        return os.stat(text)
    except OSError as err:
        if err.errno == errno.ENOENT:
            return None
        raise argparse.ArgumentTypeError(path_refusal(text, err)) from None


def _readable(text: str, st: os.stat_result) -> None:
    """Open (a file) or list (a folder) ``text`` once, as the command will: a refusal in one line."""
    try:
        if stat.S_ISDIR(st.st_mode):
            with os.scandir(text):
                pass
        else:
            os.close(os.open(text, os.O_RDONLY | os.O_NONBLOCK))  # O_NONBLOCK: a FIFO does not wait for a writer
    except OSError as err:
        raise argparse.ArgumentTypeError(path_refusal(text, err)) from None


def writable_here(folder: str | Path, shown: str | Path) -> None:
    """Refuse (one line naming ``shown``) a ``folder`` in which no file can be created: a probe file is made and
    removed at once, so the file system itself answers (read-only, permissions, /proc, a full inode table)."""
    probe = Path(folder) / f".megaformer-probe-{os.getpid()}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return
    except OSError as err:
        raise argparse.ArgumentTypeError(path_refusal(shown, err, creating=True)) from None
    os.unlink(probe)


def _names_fit(text: str, missing: Path, folder: Path) -> None:
    """Each component still to be created under ``folder`` fits the file system's name length."""
    limit = name_max(folder)
    for part in missing.relative_to(folder).parts:
        if len(os.fsencode(part)) > limit:
            raise argparse.ArgumentTypeError(path_refusal(text, OSError(errno.ENAMETOOLONG, "File name too long")))


def existing_file(text: str) -> str:
    """A path that is a readable file now ("-" for stdin is accepted)."""
    if text == "-":
        return text
    if (st := _stat(text)) is None:
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    if stat.S_ISDIR(st.st_mode):
        raise argparse.ArgumentTypeError(f"{text}: is a directory, expected a file")
    _readable(text, st)
    return text


def existing_dir(text: str) -> str:
    """A path that is a directory now."""
    if (st := _stat(text)) is None:
        raise argparse.ArgumentTypeError(f"{text}: no such directory")
    if not stat.S_ISDIR(st.st_mode):
        raise argparse.ArgumentTypeError(f"{text}: is a file, expected a directory")
    _readable(text, st)
    return text


def existing_path(text: str) -> str:
    """A file or a directory that exists now (model file, step directory or run directory)."""
    if (st := _stat(text)) is None:
        raise argparse.ArgumentTypeError(f"{text}: no such file or directory")
    _readable(text, st)
    return text


def new_file(text: str) -> str:
    """A file to write ("-" for stdout): not a directory, and its folder exists and takes new files."""
    if text == "-":
        return text
    st = _stat(text)
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise argparse.ArgumentTypeError(f"{text}: is a directory, expected a file name")
    folder = Path(text).parent
    if (folder_st := _stat(folder)) is None:
        raise argparse.ArgumentTypeError(f"{text}: folder {folder} does not exist")
    if not stat.S_ISDIR(folder_st.st_mode):
        raise argparse.ArgumentTypeError(f"{text}: {folder} is a file, not a directory")
    if st is None:
        _names_fit(text, Path(os.path.abspath(text)), Path(os.path.abspath(folder)))
    writable_here(folder, text)
    return text


def new_dir(text: str) -> str:
    """A directory to create or fill: not an existing file; its parent may be created, in a folder that takes
    new files, with names the file system allows."""
    st = _stat(text)
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise argparse.ArgumentTypeError(f"{text}: is a file, expected a directory")
    return new_path(text)


def new_path(text: str) -> str:
    """A file or directory to write (the command decides which): its folders may be created, in a folder that
    takes new files, with names the file system allows."""
    st = _stat(text)
    path = Path(os.path.abspath(text))
    ancestors = [path, *path.parents] if st is None or stat.S_ISDIR(st.st_mode) else list(path.parents)
    for parent in ancestors:  # the first existing one must be a directory that takes new files
        if (parent_st := _stat(parent)) is not None:
            if not stat.S_ISDIR(parent_st.st_mode):
                raise argparse.ArgumentTypeError(f"{text}: {parent} is a file, not a directory")
            _names_fit(text, path, parent)
            writable_here(parent, text)
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
    (new_path, "path"),
):
    _tag(_fn, _kind)
