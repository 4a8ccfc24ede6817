"""Files written whole or not at all, and their checksums: the helpers every layer that writes shares.

:func:`atomic_write_text` and :func:`atomic_torch_save` write through a temporary file in
the same folder and a rename; :func:`atomic_output` does the same for a whole folder or a file written by others (the
folder appears complete, or not at all). :func:`sha256_of` is the one checksum of a file.
:func:`path_refusal` is the one place that says, in one line, why the file system refused a path.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# ---- a path the file system refused ------------------------------------------------------------

# errno -> what it means for a path the user gave, and what to change. ENOENT, ENAMETOOLONG and ENOTDIR are said by
# path_refusal itself (they depend on the path).
_CAUSES = {
    errno.EISDIR: "is a directory, expected a file",
    errno.ELOOP: "a loop of symbolic links (too many levels to follow): point the link at a real file or directory",
    errno.EEXIST: "already exists",
}
# errno -> what to change, after the system's own words (e.g. "Read-only file system: write to another place")
_ADVICE = {
    errno.EACCES: "make it accessible to this user, or use another path",
    errno.EPERM: "make it accessible to this user, or use another path",
    errno.EROFS: "write to another place",
    errno.ENOSPC: "free space there, or write to another place",
    errno.EDQUOT: "free space in your quota, or write to another place",
}
STATE_ERRNOS = frozenset(_ADVICE)
"""The file system's state (space, permissions, read-only), not a name: said in one line even without a file name."""
PATH_ERRNOS = STATE_ERRNOS | frozenset(_CAUSES) | {errno.ENOENT, errno.ENAMETOOLONG, errno.ENOTDIR}
"""The errors a path (its name, its place, the file system it is on) causes, not the program: said in one line."""


def name_max(path: str | Path) -> int:
    """The longest file name (bytes a component) the file system at ``path``'s nearest existing folder allows."""
    for folder in [Path(os.path.abspath(path)), *Path(os.path.abspath(path)).parents]:
        try:
            return os.pathconf(folder, "PC_NAME_MAX")
        except (OSError, ValueError):
            continue
    return 255


def _file_in_the_way(path: Path) -> Path | None:
    """The first folder of ``path`` that exists and is not a directory (the cause of ENOTDIR)."""
    for parent in reversed(Path(os.path.abspath(path)).parents):
        if os.path.lexists(parent) and not os.path.isdir(parent):
            return parent
    return None


def path_refusal(path: str | Path, err: OSError, creating: bool = False) -> str:
    """``PATH: cause`` for an OSError that ``path`` caused, the true cause named (never a guess at another).

    ``creating``: the error came from creating an entry in a folder that exists, where ENOENT means the file
    system takes no new files (a special one such as /proc or /sys), not a missing name.
    """
    code = err.errno
    if code == errno.ENAMETOOLONG:
        cause = f"the name is longer than the file system allows ({name_max(path)} bytes a component)"
    elif code == errno.ENOTDIR:
        blocker = _file_in_the_way(Path(path))
        cause = f"{blocker} is a file, not a directory" if blocker else "a part of the path is not a directory"
    elif code == errno.ENOENT and creating:
        cause = "the file system there takes no new files (a special file system such as /proc): write elsewhere"
    elif code == errno.ENOENT:
        cause = "no such file or directory"
    elif code in _ADVICE:
        cause = f"{err.strerror or os.strerror(code)}: {_ADVICE[code]}"
    else:
        cause = _CAUSES.get(code, err.strerror or str(err))
    return f"{path}: {cause}"


# ---- files -------------------------------------------------------------------------------------


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def atomic_torch_save(obj: object, path: str | Path) -> None:
    """Write ``obj`` to ``path`` through a temporary file in the same folder and a rename."""
    import torch  # here: the module's other helpers serve processes that load no torch (config.dump_config)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextmanager
def atomic_output(final: Path, directory: bool = True, replace: bool = False) -> Iterator[Path]:
    """A hidden path beside ``final`` to write into; renamed to ``final`` when the block ends without error.

    ``directory``: the hidden path is a created folder (else a file path, not created).
    On an error it is removed and ``final`` is untouched. ``replace``: an existing
    ``final`` is swapped out only once the new output is complete, and put back if the
    rename fails (callers decide whether it may be replaced).
    """
    final = Path(os.path.abspath(final))  # "." or "x/.." has no name to put a temporary beside
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    _remove(tmp)
    if directory:
        tmp.mkdir()
    try:
        yield tmp
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        if replace and (final.exists() or final.is_symlink()):
            os.replace(final, old)
        try:
            os.replace(tmp, final)
        except OSError:
            if old.exists():
                os.replace(old, final)
            raise
        _remove(old)
    finally:
        _remove(tmp)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()
