"""What the bad-input tables share: the one-line error a bad input must give (the ``run`` fixture is in conftest.py)."""

from __future__ import annotations


def assert_one_line_error(code, err: str, fragment: str) -> None:
    assert code not in (0, None), err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert fragment in lines[0], lines[0]
