"""The time budget a peer trains under: megaformer's own, imported into the peers' wrappers.

megaformer bounds a run by training minutes, warms up over a share of the updates it is expected to reach at its
measured rate, to the same peak lr (:class:`megaformer.train.budget.BudgetPlan`,
:func:`megaformer.train.schedule.fitted_lr`), and saves every ``train.save_minutes`` (minutes/24 in the recipe).
Neither fairseq nor OpenNMT-py can say that on its command line (fairseq has ``--stop-time-hours`` but warms up over
a fixed count and saves by updates; OpenNMT-py stops and saves by steps only), so each peer's wrapper
(``fairseq_train.py``, ``opennmt_train.py``) asks a :class:`Budget` after every update. The schedule's functions
are megaformer's, not a copy: the wrappers put the checkout on ``sys.path`` (those two modules need only torch,
PyYAML and the standard library, which both peers' venvs have).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megaformer.train.budget import BudgetPlan  # noqa: E402
from megaformer.train.schedule import fitted_lr  # noqa: E402


def wrapper_command(argv: list[str], tool: str) -> tuple[dict, Path, list[str]]:
    """A wrapper's ``BUDGET.json SUMMARY.json -- TOOL ARGS...``: (the budget's spec, the summary path, TOOL's args)."""
    if len(argv) < 3 or argv[2] != "--":
        raise SystemExit(f"usage: {Path(sys.argv[0]).name} BUDGET.json SUMMARY.json -- {tool} ARGS...")
    return json.loads(Path(argv[0]).read_text()), Path(argv[1]), argv[3:]


class Budget:
    """The budget of ``spec`` (:func:`compare.recipe`'s): the fitted lr, the saves every minutes/saves, the end.

    The clock starts at the first :meth:`observe` (the first update: loading data and building the model are
    not counted, as megaformer counts training time); saves are made after each ``minutes / saves`` of it.
    """

    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.seconds = 60.0 * spec["minutes"]
        self.plan = BudgetPlan(spec["minutes"], 10**9, spec["warmup_fraction"], spec["warmup_max"])
        self.warmup: int | None = None  # None: warmup_max, until the plan fits it
        self.save_every = self.seconds / spec["saves"]
        self.start: float | None = None
        self.last_save = 0.0

    def clock(self) -> float:
        return 0.0 if self.start is None else time.perf_counter() - self.start

    def lr(self, update: int) -> float:
        """The lr of update ``update`` (from 1), as megaformer's schedule gives it."""
        s = self.spec
        return fitted_lr(update, s["d_model"], s["warmup_max"], s["lr_scale"], self.warmup or s["warmup_max"])

    def observe(self, updates: int) -> None:
        """Note ``updates`` done; while the warm-up lasts, fit it to the updates the budget is expected to reach."""
        if self.start is None:
            self.start = time.perf_counter()
        fitted = self.plan.fit(updates, updates, self.clock(), self.warmup)
        if fitted is not None:
            self.warmup = fitted

    def save_due(self) -> bool:
        """True when minutes/saves have passed since the last save (the caller saves then)."""
        if self.start is None or self.clock() - self.last_save < self.save_every:
            return False
        self.last_save = self.clock()
        return True

    def spent(self) -> bool:
        return self.start is not None and self.clock() >= self.seconds
