"""The training loop: steps, validation, logging, checkpoints on schedule and on signals.

One optimizer step: take this rank's micro-batches (:class:`DataFeed`), sum their
target tokens over the DP group, and back-propagate each micro-batch's *summed* loss
scaled by ``accumulation x dp / tokens``. DeepSpeed divides by the accumulation steps
and averages over DP, so the update is the gradient of the mean loss per target token
of the whole step: two micro-batches give exactly the update of one double batch, and
ranks with more tokens weigh more, as they should.

The trainer is one of the stateful components (with the engine, the data feed and torch's
RNG): its own state is the tokens and training time so far and the best validation BLEU.
Each is registered once with the :class:`~megaformer.train.checkpointer.Checkpointer`,
which saves them when its schedule says so and loads them at a resume; the run's length
as it goes (the fitted warm-up, the cool-down) is :class:`~megaformer.train.pace.Pace`'s.

Validation (every ``train.eval_interval`` steps, and at the last step) computes the loss over the valid split
and greedy BLEU on its first ``train.eval_bleu_sentences`` sentences (:class:`megaformer.train.validation.Validation`).
When BLEU beats the best so far, that step is saved (reason "best" if the schedule did not save it) and named
in ``RUN/checkpoints/best``, which pruning keeps, as fairseq's ``--eval-bleu`` keeps ``checkpoint_best.pt``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megaformer import checkpoint as ckpt
from megaformer.checkpoint import meta as schema
from megaformer.config import Config, dump_config, to_dict
from megaformer.data.batching import plan_step, stream_count
from megaformer.data.stream import TokenBatchStream
from megaformer.errors import TrainingError
from megaformer.info import model_info
from megaformer.parallel import DropoutRNG, ParallelContext
from megaformer.parallel.stages import plan_stages
from megaformer.pipeline.schedule import Pipeline
from megaformer.train.build import adopt_data, build_model, resume_point
from megaformer.train.checkpointer import RANK, REPLICA, RUN, SHARD, Checkpointer, TorchRNG
from megaformer.train.device import configure_math, host_memory
from megaformer.train.engine import build_engine
from megaformer.train.engine_state import cooldown_of
from megaformer.train.feed import DataFeed
from megaformer.train.metrics import MetricsLogger, Peak, device_peak_flops, peak_source
from megaformer.train.pace import Pace
from megaformer.train.profile import StepProfiler
from megaformer.train.schedule import cooldown_time_reached
from megaformer.train.signals import REQUEUE, TERMINATE, SignalWatch, requeue
from megaformer.train.step import Outcome, StepFlags, Window, accumulate, pipeline_step, world_sum
from megaformer.train.validation import Validation


@dataclass
class Loop:
    """What one :meth:`Trainer.train` holds while it runs: the metrics, the signal watch, the profiler, the log
    window, the step it began at and why nothing is left to train (None: something is)."""

    logger: MetricsLogger
    watch: SignalWatch
    profiler: StepProfiler
    start_step: int
    nothing_left: str | None
    window: Window = field(default_factory=Window)


class Trainer:
    def __init__(
        self,
        cfg: Config,
        ctx: ParallelContext,
        run_dir: Path,
        resume: str = "auto",
        other_tokenizer: bool = False,
        slurm_job: str | None = None,  # the SLURM job this rank runs in (launcher.env.slurm_job): requeued, recorded
    ) -> None:
        self.cfg, self.ctx, self.run_dir, self.slurm_job = cfg, ctx, Path(run_dir), slurm_job
        self.log = logging.getLogger(__name__).info  # rank 0's on the console, each rank's in its file
        manifest, self.tokenizer, self.has_valid = adopt_data(cfg, self.log)

        self.start_dir = resume_point(resume, self.run_dir, self.log)
        saved = ckpt.check_complete(self.start_dir) if self.start_dir else None
        if saved:  # refused before config.yaml is written: the run directory keeps the settings it was trained with
            ckpt.check_same_model(self.start_dir, saved, cfg.model)
            ckpt.check_same_tokenizer(self.start_dir, saved, manifest, other_tokenizer, self.log)
        if ctx.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            dump_config(cfg, self.run_dir / "config.yaml")

        t = cfg.train
        self.log(f"train: {configure_math(ctx.device, t.precision)}")
        if (pages := host_memory(ctx.device)) is not None:
            self.log(f"train: {pages}")
        self.rng = DropoutRNG(t.seed, ctx.tp, ctx.dp_rank, cfg.parallel.dropout_rng)
        self.stages = plan_stages(cfg.model, ctx.pp_size, cfg.parallel.pp_split, cfg.data.vocab_size)
        self.model = build_model(cfg, ctx, self.rng, self.stages[ctx.pp_rank], self.log)
        saved_streams = schema.require_streams(self.start_dir, saved) if saved else None
        streams = stream_count(saved_streams, ctx.dp_size)
        # The step stays within 10 % of train.tokens_per_step at any DP size (smaller micro-batches if needed).
        self.plan = plan_step(t.tokens_per_step, streams, cfg.data.max_tokens, cfg.data.max_len + 1)
        self.feed = DataFeed(
            self._stream, streams, ctx.dp_rank, ctx.dp_size, self.plan.micro_batches_per_stream, self.rng, t.seed
        )
        self.engine = build_engine(cfg, ctx, self.model, self.feed.accumulation)  # DeepSpeed's or the lean one
        self.pipeline = Pipeline(ctx, self.model, self.stages) if ctx.pp_size > 1 else None
        self.parameters = model_info(cfg)["parameters"]
        # The peak of all devices together. On a CPU every rank measures at the same time (as
        # they train): ranks that share cores then measure the share they really get.
        if dist.is_initialized():
            dist.barrier(group=ctx.world_group)
        flops = world_sum(self.ctx, [device_peak_flops(ctx.device, t.precision, t.peak_tflops)]).item()
        self.peak = Peak(flops, peak_source(ctx.device, t.peak_tflops), ctx.layout.world_size)
        self.tokens, self.train_seconds, self.world_seconds = 0, 0.0, 0.0
        self.best_bleu: float | None = None  # the best validation BLEU so far
        self._validated = -1  # the last step validated (a resume with nothing left does not repeat it)
        self.validation = Validation(cfg, ctx, self.model, self.pipeline, self._stream, self.has_valid, self.log)
        self.pace = Pace(self.engine, t, self.log)
        self.checkpointer = self._checkpointer()
        if saved:
            self._resume(self.start_dir, saved_streams)
        if self.pipeline is not None:
            self.pipeline.sync_embedding()
        self._describe(streams)

    # ---- set-up ---------------------------------------------------------------------------

    def _describe(self, streams: int) -> None:
        """The run's shape in one line: size, layout, precision, micro-batches, run directory."""
        ctx, t = self.ctx, self.cfg.train
        sp = " sequence-parallel" if ctx.layout.tp > 1 else ""  # ignored at tp=1: said with the other idle settings
        if self.pipeline is not None:
            self.log(f"train: pipeline of {ctx.pp_size} stages: " + "; ".join(p.describe() for p in self.stages))
        self.log(
            f"train: {self.parameters / 1e6:.1f}M parameters, tp={ctx.layout.tp}{sp * self.cfg.parallel.sequence_parallel} dp={ctx.layout.dp} pp={ctx.pp_size} "
            f"{self.engine.describe()} {t.precision}, {self.feed.accumulation} micro-batch{'es' * (self.feed.accumulation > 1)} of <= "
            f"{self.plan.max_tokens_per_micro_batch} tokens per rank per step ({streams} data stream{'s' * (streams != 1)}, "
            f"~{self.plan.tokens_per_step:,} tokens per step), run dir {self.run_dir}"
        )
        self.log(f"train: {self.peak.describe()}")

    def _stream(self, index: int, count: int, split: str = "train") -> TokenBatchStream:
        """Training batches are cut to the step plan's size; validation batches to ``data.max_tokens``."""
        training = split == "train"
        return TokenBatchStream.from_config(
            self.cfg.data,
            split,
            dp_rank=index,
            dp_size=count,
            shuffle=training,
            repeat=training,
            max_tokens=self.plan.max_tokens_per_micro_batch if training else 0,
            pin_memory=self.ctx.device.type == "cuda",
        )

    # ---- state ------------------------------------------------------------------------------

    def _checkpointer(self) -> Checkpointer:
        """The checkpointer of ``RUN/checkpoints``, every stateful component registered (loaded in this order)."""
        stages = [len(p.encoder) + len(p.decoder) for p in self.stages] if self.ctx.pp_size > 1 else None
        checkpointer = Checkpointer(
            self.ctx,
            self.run_dir / "checkpoints",
            self.cfg.train,
            stages,
            self._meta_of_run,
            self.slurm_job,
            self.tokenizer,
            self.log,
            clock=time.monotonic,
        )
        checkpointer.register("engine", self.engine, SHARD)  # weights, Adam, counters, the lr schedule
        checkpointer.register("trainer", self, RUN)  # after the engine: an old trainer state holds a cool-down
        checkpointer.register(schema.FEED, self.feed, REPLICA)
        checkpointer.register("torch_rng", TorchRNG(), RANK)
        return checkpointer

    def _meta_of_run(self) -> dict:
        """What a checkpoint's meta.json says of the run beside the states."""
        return {"tokens": self.tokens, "vocab_size": self.cfg.data.vocab_size, "config": to_dict(self.cfg)}

    def state_dict(self) -> dict:
        """The trainer's own state: target tokens, training seconds, the best validation BLEU so far
        (None before the first) and the last step validated (the step and the lr schedule are the engine's)."""
        t, seconds, best, validated = self.tokens, self.train_seconds, self.best_bleu, self._validated
        return {"tokens": t, "train_seconds": seconds, "best_bleu": best, "validated": validated}

    def load_state_dict(self, state: dict) -> None:
        self.tokens, self.train_seconds = int(state["tokens"]), float(state["train_seconds"])
        best = state.get("best_bleu")  # absent in checkpoints written before BLEU was tracked
        self.best_bleu = None if best is None else float(best)
        self._validated = int(state.get("validated", -1))  # absent before it was kept
        if state.get("cooldown") is not None:  # checkpoints of before the cool-down moved to the engine's state
            self.engine.set_cooldown(cooldown_of(state["cooldown"]))

    def _resume(self, step_dir: Path, saved_streams: int) -> None:
        """Every registered state from ``step_dir``; then what the resume changes, each said in a line."""
        meta = self.checkpointer.load(step_dir, self.model)
        if (cooldown := self.engine.cooldown) is not None and not self.cfg.train.cooldown_fraction:
            self.log(
                f"train: train.cooldown_fraction=0: the checkpoint's cool-down (updates {cooldown.start}.."
                f"{cooldown.end}) is dropped; the lr follows the plain schedule"
            )
            self.engine.set_cooldown(None)
        if saved_streams != self.feed.streams:
            self.log(
                f"train: data re-planned: the checkpoint's data streams ({saved_streams}) do not divide among "
                f"{self.ctx.dp_size} DP ranks; the rest of the epoch is planned for {self.feed.streams} (other "
                f"batches and masks than the old layout's; a DP size dividing {saved_streams} continues exactly)"
            )
        change = ckpt.layout_change(schema.layout_of(meta), self.ctx.layout)
        self.log(f"train: resumed from {step_dir} (step {schema.step_of(meta)}, {self.tokens:,} target tokens{change})")
        if since := ckpt.changed_since(schema.config_of(meta), self.cfg):
            self.log(f"train: changed since the checkpoint: {since}")

    # ---- one step ---------------------------------------------------------------------------

    def step(self, flags: StepFlags) -> tuple[float, float, StepFlags]:
        """One optimizer step: (the step's DP-summed loss, its DP target tokens, the flags of any rank).

        The world's target tokens, the loss's normalisation, are summed on the device before the
        backward. One all-reduce after the step carries what every rank must agree on: the flags
        said before it (signals received, time up, a save due, so that every rank stops and saves
        at the same step), the token count, the training time, the loss and whether any rank saw
        a non-finite loss or gradient norm. Reading it is the step's one wait for the device.
        """
        micro = self.feed.next_step()
        local = float(sum(m.batch.tgt_tokens for m in micro))
        replica = self.ctx.layout.tp * self.ctx.pp_size  # every rank of a replica (TP x PP) counts the same tokens
        tokens = world_sum(self.ctx, [local])[0] / replica  # a 0-dim tensor: the loss scale stays a scalar
        skipped_before = self.engine.skipped_steps
        if self.pipeline is None:
            loss = accumulate(self.engine, micro, tokens, self.cfg.train.label_smoothing, self.feed.dropout_of)
        else:  # a pipeline's transfers wait for the device anyway
            loss = pipeline_step(self.engine, self.pipeline, self.feed, micro, float(tokens), self.cfg.train)
        # DeepSpeed skips the update on inf/NaN gradients in every precision; only in fp16 is that the
        # loss scaler's overflow (lower the scale, go on). In fp32 and bf16 it is a diverged run.
        skipped_now = self.engine.skipped_steps > skipped_before
        skipped = skipped_now and self.cfg.train.precision == "fp16"
        if skipped:  # an fp16 overflow's step updated nothing: its loss does not count, nor is the run broken
            loss = broken = torch.zeros_like(loss)
        else:
            broken = (self.engine.not_finite(loss) | skipped_now).float()
        # Only a pipeline's last stage holds the loss (the others add 0); TP peers hold it each.
        reduced = world_sum(self.ctx, [local, self.train_seconds] + flags.as_floats(), (loss, broken)).tolist()
        # The mean training time before the step is the same on every rank (the time budget's rate).
        tokens, self.world_seconds = reduced[0] / replica, reduced[1] / self.ctx.layout.world_size
        flags, (loss_sum, broken_ranks) = StepFlags.any_of(reduced[2:-2]), reduced[-2:]
        if broken_ranks:
            raise TrainingError(
                f"step {self.engine.global_steps}: the loss or the gradient norm is not finite (loss {float(loss):g}, "
                f"gradient norm {self.engine.grad_norm()}); nothing was saved. Likely causes: a learning rate too "
                f"high (train.lr_scale={self.cfg.train.lr_scale}, train.warmup_steps={self.cfg.train.warmup_steps}) "
                f"or fp16 without enough loss-scale headroom; resume from the last checkpoint with a lower lr_scale"
            )
        return loss_sum / self.ctx.layout.tp, 0.0 if skipped else tokens, flags

    # ---- the loop ---------------------------------------------------------------------------

    def train(self) -> int:
        """Train to ``train.max_steps``; returns the process exit status.

        Each step reads top to bottom: the step (with what this rank says before it), its record
        (time, tokens, the fitted warm-up, the cool-down, the log line), validation, the save and
        the stop. All after the step is decided from the world's flags: every rank takes the same branch.
        """
        loop = self._open_loop()
        try:
            while self._steps_left(loop):
                said = self._flags(loop.watch)
                began = time.perf_counter()
                with loop.profiler.step(self.engine.global_steps + 1):
                    loss_sum, tokens, world = self.step(said)
                after = self._record(loop, loss_sum, tokens, time.perf_counter() - began, world)
                best = self._validate_due(loop, after)
                self.checkpointer.save_if_due(after, best)
                if (status := self._stop(loop, after)) is not None:
                    return status
            self._validate_unvalidated(loop)
        finally:
            loop.watch.restore()
            loop.logger.close()
            self.feed.close()
        return 0

    def _open_loop(self) -> Loop:
        """The engine in training mode, the metrics, the signal watch, the profiler; what is left said."""
        t = self.cfg.train
        self.engine.train()
        if (nothing_left := self.pace.nothing_left(self.train_seconds)) is not None:
            self.log(f"train: nothing to train: {nothing_left}")
        logger = MetricsLogger(self.run_dir, self.ctx.is_main, t.max_steps)
        watch = SignalWatch(self.slurm_job)
        start_step = self.engine.global_steps
        self.checkpointer.restart_clock()
        profiler = StepProfiler(
            t.profile_from, t.profile_steps, self.run_dir / "profile", self.ctx.rank, self.ctx.device, self.log
        )
        return Loop(logger, watch, profiler, start_step, nothing_left)

    def _steps_left(self, loop: Loop) -> bool:
        """Another step: the run had something left, train.max_steps is not reached, the cool-down not ended."""
        return (
            loop.nothing_left is None and self.engine.global_steps < self.cfg.train.max_steps and not self.pace.cooled()
        )

    def _flags(self, watch: SignalWatch) -> StepFlags:
        """What this rank says before the step: a signal received, its training time spent (or the cool-down's
        share of it), train.save_minutes passed by its clock; the step makes them the world's."""
        t, seconds, received = self.cfg.train, self.train_seconds, watch.received
        return StepFlags(
            usr1=received == REQUEUE,
            term=received == TERMINATE,
            time_up=t.max_minutes > 0 and seconds >= 60 * t.max_minutes,
            save_due=self.checkpointer.minutes_passed(),
            cooldown=cooldown_time_reached(t.cooldown_fraction, seconds, t.max_minutes),
        )

    def _record(self, loop: Loop, loss_sum: float, tokens: float, seconds: float, world: StepFlags) -> Outcome:
        """Count the step's time and tokens, fit the warm-up, begin the cool-down, log at ``train.log_interval``;
        returns the step as every rank sees it."""
        t = self.cfg.train
        self.train_seconds += seconds
        self.tokens += int(tokens)
        loop.window.add(loss_sum, tokens, seconds)
        self.pace.fit_warmup(self.world_seconds)
        cooled = self.pace.cool_down(world.cooldown, self.world_seconds)
        step = self.engine.global_steps
        if step % t.log_interval == 0 or step == t.max_steps:
            self._log(loop.logger, loop.window)
            loop.window.reset()
        end = "time limit" if world.time_up else "cool-down" if cooled else None
        return Outcome(step, world.signal, end, world.save_due, step == t.max_steps, loop.watch.stopped_by)

    def _validate_due(self, loop: Loop, after: Outcome) -> bool:
        """Validate every ``train.eval_interval`` steps and before the run's last save; True for a best BLEU."""
        every = self.cfg.train.eval_interval
        return bool(every) and (after.step % every == 0 or after.last) and self._validate(loop.logger, after.step)

    def _stop(self, loop: Loop, after: Outcome) -> int | None:
        """The exit status if the run stops after this step (a signal, the time limit, the cool-down's end)."""
        step = after.step
        if after.signal == REQUEUE:
            loop.watch.note_requeue()
            accepted = requeue(self.slurm_job, step > loop.start_step, self.log) if self.ctx.is_main else False
            self.log(f"train: stopping at step {step} after SIGUSR1 ({'' if accepted else 'not '}requeued)")
            return 0
        if after.signal == TERMINATE:  # a peer's SIGTERM is this rank's too; Ctrl-C reaches every rank
            self.log(f"train: stopping at step {step} after {loop.watch.stopped_by} (saved)")
            return loop.watch.exit_status
        if after.end == "time limit":
            self.log(f"train: train.max_minutes={self.cfg.train.max_minutes} reached at step {step}")
        elif after.end == "cool-down":
            self.log(f"train: the cool-down ended at step {step}")
        return None if after.end is None else 0

    def _validate_unvalidated(self, loop: Loop) -> None:
        """Only a run resumed at its last step, saved there on a signal, ends unvalidated: validated, saved again."""
        step, every = self.engine.global_steps, self.cfg.train.eval_interval
        if every and step % every and self._validated != step:
            best = self._validate(loop.logger, step)
            self.checkpointer.save(step, "best" if best else "validated", best=best)

    def _log(self, logger: MetricsLogger, window: Window) -> None:
        tokens_per_s = window.tokens / max(window.seconds, 1e-9)
        record = {
            "step": self.engine.global_steps,
            "loss": window.loss / window.tokens if window.tokens else None,  # None: only skipped fp16 steps
            "lr": self.engine.lr(),
            "grad_norm": self.engine.grad_norm(),
            "loss_scale": self.engine.loss_scale(),
            "tokens": self.tokens,
            "tokens_per_s": tokens_per_s,
            "mfu": self.peak.mfu(6 * self.parameters * tokens_per_s, self.log),  # None beyond the peak
            "epoch": self.feed.epoch(),
            "skipped_steps": self.engine.skipped_steps,
            "train_seconds": self.train_seconds,
        }
        if self.pipeline is not None and self.pipeline.host_waits:
            # This stage's share of the window spent waiting for its neighbours: the bubble plus transfers.
            waited = self.pipeline.wait_seconds - window.waited_from
            record["pipeline_wait"] = waited / max(window.seconds, 1e-9)
            window.waited_from = self.pipeline.wait_seconds
        logger.log(record)
        logger.console(record)

    def _validate(self, logger: MetricsLogger, step: int) -> bool:
        """Validate, log; True when BLEU beats the best so far (it becomes the best; every rank agrees)."""
        self._validated = step
        result = self.validation.run()
        if result is None:
            return False
        logger.log({"step": step, **result}, prefix="valid")
        logger.console_valid({"step": step, **result})
        improved = "bleu" in result and (self.best_bleu is None or result["bleu"] > self.best_bleu)
        if improved:
            self.best_bleu = result["bleu"]
        return improved
