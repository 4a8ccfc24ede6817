"""A recipe's steps: commands run from the checkout, each logged before it runs, any failure one line naming it."""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from megaformer.errors import MegaformerError

ROOT = Path(__file__).resolve().parents[2]
LOG = logging.getLogger("megaformer.recipes")


class RecipeError(MegaformerError):
    """A step of a recipe that failed, or a recipe that cannot start; says which and what to look at."""


def megaformer(*args: str) -> list[str]:
    """The argv of a ``megaformer`` sub-command, run by this interpreter."""
    return [sys.executable, "-m", "megaformer.cli", *args]


@dataclass(frozen=True)
class Step:
    """One command of a recipe: what it does (``title``), its argv, and variables added to its environment."""

    title: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def shown(self) -> str:
        """The command as a user would type it: ``megaformer ...`` for this interpreter's sub-commands."""
        ours = self.argv[:3] == megaformer()
        added = "".join(f"{k}={shlex.quote(v)} " for k, v in self.env.items())
        return added + ("megaformer " if ours else "") + shlex.join(self.argv[3:] if ours else self.argv)

    def run(self) -> None:
        """Run from the checkout, output passed through; a non-zero status is a RecipeError naming the step."""
        LOG.info("\n== %s\n$ %s", self.title, self.shown())
        sys.stdout.flush()
        proc = subprocess.run(self.argv, cwd=ROOT, env={**os.environ, **self.env} if self.env else None)
        if proc.returncode != 0:
            raise RecipeError(f"{self.title}: failed with status {proc.returncode} (its output is above)")


def shown_path(path: Path) -> str:
    """``path`` relative to the checkout where it lies inside it (as the user typed it there), else absolute."""
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)
