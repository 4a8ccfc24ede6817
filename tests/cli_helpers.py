"""What the bad-input tables share: the one-line error a bad input must give, and a digest of what must not change (the ``run`` fixture is in conftest.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def assert_one_line_error(code, err: str, fragment: str) -> None:
    assert code not in (0, None), err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert fragment in lines[0], lines[0]


def tree_digest(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder``, by relative path: what must not change on disk."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }
