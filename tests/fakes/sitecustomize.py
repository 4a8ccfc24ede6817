"""Fault injection for the training tests, loaded by Python at start-up when this folder is on PYTHONPATH.

MEGAFORMER_TEST_FAULT holds one fault, ``what:rank=R:step=N``:

- ``kill``: SIGKILL this process after optimizer step N (on rank R);
- ``kill_in_save``: SIGKILL right after this rank wrote its model file of checkpoint N;
- ``usr1`` / ``term``: send SIGUSR1 / SIGTERM to this process after step N;
- ``overflow``: make step N's loss infinite (fp16 overflow); in a pipeline, the gradients of
  rank R's stage only;
- ``nan``: make step N's loss NaN (a diverged run, in any precision);
- ``fast_clock``: the trainer's ``time.monotonic`` on rank R runs N times as fast (ranks'
  clocks that disagree about when ``train.save_minutes`` has passed);
- ``slow``: every optimizer step ends N milliseconds later, on every rank (a SLURM job that
  must still be training when a signal comes, without computing all that while);
- ``step_clock``: every optimizer step lasts exactly N milliseconds by the trainer's step clock
  (``time.perf_counter``), on every rank: a time budget's fits and cool-down come out the same
  whatever the machine's speed or load.

MEGAFORMER_TEST_HASH_LOG names a file to which every call of ``megaformer.files.sha256_of`` in this process
(and in the ranks it forks) appends one line, ``PID PATH``: how often each file is hashed, counted across processes.

Nothing here is imported by megaformer itself: the hook wraps the trainer when it is imported.
"""

import importlib.abc
import importlib.util
import os
import signal
import sys
import time

SPEC = os.environ.get("MEGAFORMER_TEST_FAULT", "")
HASH_LOG = os.environ.get("MEGAFORMER_TEST_HASH_LOG", "")


def _parse(spec):
    what, *rest = spec.split(":")
    fields = dict(item.split("=", 1) for item in rest)
    return what, int(fields.get("rank", -1)), int(fields.get("step", 0))


def _mine(rank):
    return rank < 0 or int(os.environ.get("RANK", "0")) == rank


class _Time:
    """The ``time`` module, of which a subclass changes one clock."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)


class _FastClock(_Time):
    """The ``time`` module with ``monotonic`` running ``factor`` times as fast."""

    def __init__(self, real, factor):
        super().__init__(real)
        self._factor = factor

    def monotonic(self):
        return self._real.monotonic() * self._factor


class _StepClock(_Time):
    """The ``time`` module with a ``perf_counter`` that moves ``seconds`` at each call: the trainer reads it at
    a step's start and end, so each step lasts exactly that long."""

    def __init__(self, real, seconds):
        super().__init__(real)
        self._seconds, self._calls = seconds, 0

    def perf_counter(self):
        self._calls += 1
        return self._calls * self._seconds


def _patch_trainer(module):
    what, rank, step = _parse(SPEC)
    if what == "fast_clock":
        if _mine(rank):
            module.time = _FastClock(module.time, step)
        return
    if what == "step_clock":
        module.time = _StepClock(module.time, step / 1000)
        return
    original = module.Trainer.step
    if what == "slow":

        def slow_step(self, flags):
            result = original(self, flags)
            time.sleep(step / 1000)
            return result

        module.Trainer.step = slow_step
        return

    def step_with_fault(self, flags):
        target = self.engine.global_steps + 1
        if what in ("overflow", "nan") and target == step and getattr(self, "pipeline", None) is not None:
            # A pipeline stage: every backward of this rank's stage gets an infinite (NaN) gradient.
            if not _mine(rank):
                return original(self, flags)
            backward, value = self.engine.backward, float("inf" if what == "overflow" else "nan")
            self.engine.backward = lambda loss, **kw: backward(loss * value, **kw)
            try:
                return original(self, flags)
            finally:
                del self.engine.backward
        if what in ("overflow", "nan") and target == step:
            loss_fn, value = self.model.loss, float("inf" if what == "overflow" else "nan")
            self.model.loss = lambda *a, **k: (lambda out: (out[0] * value, out[1]))(loss_fn(*a, **k))
            try:
                return original(self, flags)
            finally:
                del self.model.loss
        result = original(self, flags)
        if self.engine.global_steps == step and _mine(rank):
            sig = {"kill": signal.SIGKILL, "usr1": signal.SIGUSR1, "term": signal.SIGTERM}.get(what)
            if sig is not None:
                sys.stdout.flush()
                os.kill(os.getpid(), sig)
        return result

    module.Trainer.step = step_with_fault


def _patch_checkpoint(module):
    what, rank, step = _parse(SPEC)
    original = module.atomic_torch_save

    def save_then_die(obj, path):
        original(obj, path)
        name = os.path.basename(str(path))
        if name.startswith("model-") and f"step-{step:08d}" in str(path) and _mine(rank):
            os.kill(os.getpid(), signal.SIGKILL)

    module.atomic_torch_save = save_then_die


def _patch_files(module):
    original = module.sha256_of

    def logged_sha256_of(path):
        with open(HASH_LOG, "a") as log:
            log.write(f"{os.getpid()} {os.path.realpath(path)}\n")
        return original(path)

    module.sha256_of = logged_sha256_of


PATCHES = {"megaformer.train.trainer": _patch_trainer} if SPEC else {}
if SPEC.startswith("kill_in_save"):
    PATCHES = {"megaformer.checkpoint.files": _patch_checkpoint}  # write_shard's atomic_torch_save
if HASH_LOG:
    PATCHES["megaformer.files"] = _patch_files


class _Hook(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        self._real = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._real.create_module(spec)

    def exec_module(self, module):
        self._real.exec_module(module)
        PATCHES[module.__name__](module)


if PATCHES:
    sys.meta_path.insert(0, _Hook())
