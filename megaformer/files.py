"""Files written whole or not at all, and their checksums: the helpers every layer that writes shares.

:func:`atomic_write_text` and :func:`atomic_torch_save` write through a temporary file in
the same folder and a rename; :func:`atomic_output` does the same for a whole folder or a file written by others (the
folder appears complete, or not at all). :func:`sha256_of` is the one checksum of a file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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
