"""The checkpointer: the run's stateful components registered once, and when their states are saved.

Each component owns its state (``state_dict()`` / ``load_state_dict()``) and is registered
with the place it lives (torchtitan's ``CheckpointManager(states=...)``)::

    SHARD     the engine: {"tensors": at this rank's TP shape, complete over DP -> the model file,
                           "counters": -> run[name]}; one component only
    RUN       equal on every rank, written once (the trainer)            -> run[name]
    REPLICA   small, rank by rank (the data feed)                          -> replicas[rank][name]
    RANK      this rank's own bulky state (the torch RNG)                 -> rank-NNNNN.pt[name]

A REPLICA component is loaded with ``load_replicas(states of every old DP rank, the state of
the old rank at its place or None)``, so that it can continue at another DP size.

The checkpointer also owns the save schedule (:meth:`Checkpointer.reason`): every
``train.save_interval`` steps, after ``train.save_minutes``, at the last step, on a signal, at
the time limit or the cool-down's end, and where validation found the best BLEU so far. Every
input of that decision is the world's (the step's all-reduce), so every rank saves alike.
:mod:`megaformer.checkpoint` places, writes and reads; :mod:`megaformer.checkpoint.meta` owns
meta.json's schema.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from megaformer import checkpoint as ckpt
from megaformer.checkpoint import meta as schema
from megaformer.config import TrainConfig
from megaformer.errors import CheckpointError
from megaformer.parallel import ParallelContext
from megaformer.train.signals import REQUEUE, TERMINATE
from megaformer.train.step import Outcome

LOG = logging.getLogger(__name__)

SHARD, RUN, REPLICA, RANK = "shard", "run", "replica", "rank"


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class TorchRNG:
    """torch's global RNG of this process, as a component (each rank's own)."""

    def state_dict(self) -> torch.Tensor:
        return torch.get_rng_state()

    def load_state_dict(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)


class Checkpointer:
    """Saves and loads the registered states under ``RUN/checkpoints``; decides when to save.

    ``stages``: the run's layers per pipeline stage (None without a pipeline), which a resume
    at another cut needs; ``describe()``: what meta.json says of the run beside the states (the
    trainer's tokens, vocabulary and config); ``slurm_job``: the job that saves (a requeued job
    started with ``--resume none`` continues its own saves); ``clock``: ``train.save_minutes``'s.
    """

    def __init__(
        self,
        ctx: ParallelContext,
        root: Path,
        t: TrainConfig,
        stages: list[int] | None,
        describe: Callable[[], dict],
        slurm_job: str | None = None,
        tokenizer: Path | None = None,
        log: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ctx, self.root, self.t, self.stages, self.describe = ctx, root, t, stages, describe
        self.slurm_job, self.tokenizer, self.log, self.clock = slurm_job, tokenizer, log or LOG.info, clock
        self.states: dict[str, tuple[Stateful, str]] = {}
        self.last_save = clock()

    def register(self, name: str, component: Stateful, place: str) -> None:
        """File ``component``'s state under ``name`` at ``place``; states load in the order registered."""
        if place == SHARD and any(p == SHARD for _, p in self.states.values()):
            raise ValueError(f"{name}: one component holds the model file's tensors, and one is registered")
        self.states[name] = (component, place)

    # ---- when ------------------------------------------------------------------------------

    def restart_clock(self) -> None:
        """``train.save_minutes`` count from now (the loop's start)."""
        self.last_save = self.clock()

    def minutes_passed(self) -> bool:
        """``train.save_minutes`` passed since the last save by this rank's clock: a flag the step makes the
        world's, so that every rank enters the save's collectives together."""
        return self.t.save_minutes > 0 and self.clock() - self.last_save >= 60 * self.t.save_minutes

    def reason(self, after: Outcome, best: bool) -> str | None:
        """Why the step ``after`` describes is saved, or None: a signal, the run's end, the schedule, a best BLEU."""
        if after.signal == TERMINATE:
            return after.stopped_by
        if after.signal == REQUEUE:
            return "SIGUSR1"
        if after.end is not None:
            return after.end
        interval = self.t.save_interval and after.step % self.t.save_interval == 0
        if interval or after.save_due or after.final:
            return "schedule"
        return "best" if best else None

    def save_if_due(self, after: Outcome, best: bool) -> None:
        """Save when :meth:`reason` says so; ``best``: the step's BLEU is the best so far (named ``best``)."""
        if (reason := self.reason(after, best)) is not None:
            self.save(after.step, reason, best=best)

    # ---- what ------------------------------------------------------------------------------

    def save(self, step: int, reason: str, best: bool = False) -> Path:
        """Save every registered state as ``step``'s checkpoint; ``best``: also name it in ``checkpoints/best``."""
        state = ckpt.CheckpointState(shard={}, run={}, replica={}, rank={})
        for name, (component, place) in self.states.items():
            if place == SHARD:
                both = component.state_dict()
                state.shard, state.run[name] = both["tensors"], both["counters"]
            else:
                getattr(state, place)[name] = component.state_dict()
        meta = {
            "stages": self.stages,
            **self.describe(),
            "reason": reason,
            "slurm_job": self.slurm_job,
            "time": time.time(),
            "best": best,
        }
        path = ckpt.save_checkpoint(
            self.root, step, self.ctx, state, meta, keep_last=self.t.keep_last, tokenizer=self.tokenizer
        )
        self.log(f"checkpoint: saved {path} ({reason})")
        self.last_save = self.clock()
        return path

    def load(self, step_dir: Path, model: torch.nn.Module) -> dict:
        """Load every registered state from ``step_dir``, written at any layout, into ``model``'s part and the
        components (:func:`megaformer.checkpoint.load_checkpoint`); returns its meta.json."""
        loaded = ckpt.load_checkpoint(step_dir, self.ctx, model, self.stages)
        meta = loaded.meta
        for name, (component, place) in self.states.items():
            if place == REPLICA:
                here = schema.replica_state_at(meta, name, self.ctx.dp_rank, self.ctx.tp.rank)
                component.load_replicas(schema.replica_states(meta, name), here)
            elif place == RANK:
                if loaded.rank is not None:
                    component.load_state_dict(loaded.rank[name])
            else:
                self._load_run_state(step_dir, name, component, place, loaded)
        return meta

    def _load_run_state(
        self, step_dir: Path, name: str, component: Stateful, place: str, loaded: ckpt.LoadedCheckpoint
    ) -> None:
        """A state of meta.json's ``run`` (with the model file's tensors for SHARD); a malformed one is one line."""
        try:
            state = schema.run_state(loaded.meta, name)
            component.load_state_dict({"tensors": loaded.shard, "counters": state} if place == SHARD else state)
        except (KeyError, TypeError, ValueError, IndexError) as err:
            run = " or ".join(f"run.{n}" for n, (_, p) in self.states.items() if p in (SHARD, RUN))
            raise CheckpointError(
                f"{step_dir / 'meta.json'}: {run} is malformed ({type(err).__name__}: {err}); "
                f"resume from another checkpoint"
            ) from None
