"""The training loop: steps, validation, logging, checkpoints on schedule and on signals.

One optimizer step: take this rank's micro-batches (:class:`DataFeed`), sum their
target tokens over the DP group, and back-propagate each micro-batch's *summed* loss
scaled by ``accumulation x dp / tokens``. DeepSpeed divides by the accumulation steps
and averages over DP, so the update is the gradient of the mean loss per target token
of the whole step: two micro-batches give exactly the update of one double batch, and
ranks with more tokens weigh more, as they should.

The trainer is one of the stateful components (with the engine and the data feed): its
own state is the tokens and training time so far and the best validation BLEU;
:meth:`Trainer.save` hands every component's state to :mod:`megaformer.checkpoint`,
which places and writes them.

Validation (every ``train.eval_interval`` steps, and at the last step) computes the loss over the valid split
and greedy BLEU on its first ``train.eval_bleu_sentences`` sentences (:class:`megaformer.train.validation.Validation`).
When BLEU beats the best so far, that step is saved (reason "best" if the schedule did not save it) and named
in ``RUN/checkpoints/best``, which pruning keeps, as fairseq's ``--eval-bleu`` keeps ``checkpoint_best.pt``.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from megaformer import checkpoint as ckpt
from megaformer.config import Config, dump_config, to_dict
from megaformer.data.batching import plan_step, stream_count
from megaformer.data.manifest import manifest_path, read_manifest
from megaformer.data.stream import TokenBatchStream, open_prepared
from megaformer.data.tokenizer import PAD_ID
from megaformer.errors import CheckpointError, ConfigError, TrainingError
from megaformer.info import model_info
from megaformer.model import Transformer
from megaformer.parallel import DropoutRNG, ParallelContext
from megaformer.parallel.stages import plan_stages
from megaformer.pipeline.schedule import Pipeline
from megaformer.train.budget import BudgetPlan, compile_choice, nothing_left_to_train
from megaformer.train.device import configure_math, cpu_bf16_missing, host_memory, require_cpp_compiler
from megaformer.train.engine import build_engine
from megaformer.train.engine_state import cooldown_of
from megaformer.train.feed import DataFeed
from megaformer.train.metrics import MetricsLogger, Peak, device_peak_flops, peak_source
from megaformer.train.profile import StepProfiler
from megaformer.train.schedule import cooldown_start, cooldown_time_reached
from megaformer.train.signals import NONE, REQUEUE, TERMINATE, SignalWatch, requeue
from megaformer.train.step import StepFlags, Window, accumulate, pipeline_step, world_sum
from megaformer.train.unused import settings_without_effect
from megaformer.train.validation import Validation


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
        self.log = print if ctx.is_main else (lambda *a, **k: None)
        manifest = self._adopt_data()

        self.start_dir = self._resume_point(resume)
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
        self.model = self._build_model()
        streams = stream_count(saved["replicas"][0]["feed"]["streams"] if saved else None, ctx.dp_size)
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
        self.budget = BudgetPlan(t.max_minutes, t.max_steps, t.warmup_fraction, t.warmup_steps)
        self._warmup_said: int | None = None  # the fitted warm-up last logged; None again once its end is
        self.best_bleu: float | None = None  # the best validation BLEU so far
        self._validated = -1  # the last step validated (a resume with nothing left does not repeat it)
        self.validation = Validation(cfg, ctx, self.model, self.pipeline, self._stream, self.has_valid, self.log)
        if saved:
            self._load(self.start_dir)
        if self.pipeline is not None:
            self.pipeline.sync_embedding()
        self._describe(streams)

    # ---- set-up ---------------------------------------------------------------------------

    def _adopt_data(self) -> dict:
        """The prepared data's manifest; its vocabulary and direction become the run's (``cfg.data``)."""
        cfg = self.cfg
        if not cfg.data.path:
            raise ConfigError("data.path is empty: set it to a directory written by `megaformer prepare`")
        manifest = read_manifest(manifest_path(cfg.data.path))
        if idle := settings_without_effect(cfg, int(manifest["tokenizer"]["vocab_size"])):
            self.log(f"train: without effect in this run: {'; '.join(idle)}")
        cfg.data.vocab_size = int(manifest["tokenizer"]["vocab_size"])  # the data's, as its direction:
        cfg.data.src_lang, cfg.data.tgt_lang = manifest["src_lang"], manifest["tgt_lang"]
        self.tokenizer = open_prepared(cfg.data.path, "train").tokenizer_path
        self.has_valid = "valid" in manifest["splits"]
        return manifest

    def _build_model(self) -> Transformer:
        """This rank's part of the model (its pipeline stage, its TP shard) on the run's device, compiled if asked."""
        cfg, ctx, t = self.cfg, self.ctx, self.cfg.train
        model = Transformer(
            cfg.model,
            cfg.data.vocab_size,
            ctx.tp,
            self.rng,
            seed=t.seed,
            sequence_parallel=cfg.parallel.sequence_parallel,
            vocab_multiple=cfg.parallel.vocab_multiple,
            pad_to_multiple=cfg.parallel.pad_to_multiple,
            pad_id=PAD_ID,
            part=self.stages[ctx.pp_rank],
        ).to(ctx.device)
        native_bf16 = ctx.device.type != "cpu" or cpu_bf16_missing() is None
        compiled, why = compile_choice(t.compile, ctx.device, t.precision, t.max_minutes, native_bf16)
        if compiled:
            if ctx.device.type == "cpu":
                require_cpp_compiler()
            model.compile_layers()
        self.log(
            f"train: {why}"
            + ("; the encoder and decoder layers run compiled (the first steps compile them)" if compiled else "")
        )
        return model

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

    def _resume_point(self, resume: str) -> Path | None:
        if resume != "auto":
            return None if resume == "none" else ckpt.resolve_checkpoint(resume, log=self.log)
        found = ckpt.find_latest(self.run_dir, log=self.log)
        if found is None:
            self.log(f"train: no checkpoint under {self.run_dir}, starting from scratch")
        return found

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

    def _load(self, step_dir: Path) -> None:
        loaded = ckpt.load_checkpoint(step_dir, self.ctx, self.model, self._stage_counts())
        try:
            self.engine.load_state_dict({"tensors": loaded.shard, "counters": loaded.run["engine"]})
            self.load_state_dict(loaded.run["trainer"])
        except (KeyError, TypeError, ValueError, IndexError) as err:
            raise CheckpointError(
                f"{step_dir / 'meta.json'}: run.engine or run.trainer is malformed ({type(err).__name__}: {err}); "
                f"resume from another checkpoint"
            ) from None
        if (cooldown := self.engine.cooldown) is not None and not self.cfg.train.cooldown_fraction:
            self.log(
                f"train: train.cooldown_fraction=0: the checkpoint's cool-down (updates {cooldown.start}.."
                f"{cooldown.end}) is dropped; the lr follows the plain schedule"
            )
            self.engine.set_cooldown(None)
        same_rank = loaded.replica_at(self.ctx.dp_rank, self.ctx.tp.rank)
        saved = self.feed.load_replicas(
            [r["feed"] for r in loaded.replicas_of_dp_ranks()], same_rank and same_rank["feed"]
        )
        if saved != self.feed.streams:
            self.log(
                f"train: data re-planned: the checkpoint's data streams ({saved}) do not divide among "
                f"{self.ctx.dp_size} DP ranks; the rest of the epoch is planned for {self.feed.streams} (other "
                f"batches and masks than the old layout's; a DP size dividing {saved} continues exactly)"
            )
        if loaded.rank is not None:
            torch.set_rng_state(loaded.rank["torch_rng"])
        change = ckpt.layout_change(loaded.meta["layout"], self.ctx.layout)
        self.log(f"train: resumed from {step_dir} (step {loaded.meta['step']}, {self.tokens:,} target tokens{change})")
        if since := ckpt.changed_since(loaded.meta.get("config"), self.cfg):
            self.log(f"train: changed since the checkpoint: {since}")

    def _stage_counts(self) -> list[int] | None:
        """Layers per pipeline stage, as meta.json keeps them (None without a pipeline)."""
        return [len(p.encoder) + len(p.decoder) for p in self.stages] if self.ctx.pp_size > 1 else None

    def save(self, reason: str, best: bool = False) -> Path:
        """Save a checkpoint of this step; ``best``: also name it in ``checkpoints/best``."""
        engine = self.engine.state_dict()
        path = ckpt.save_checkpoint(
            self.run_dir / "checkpoints",
            self.engine.global_steps,
            self.ctx,
            ckpt.CheckpointState(
                shard=engine["tensors"],
                run={"engine": engine["counters"], "trainer": self.state_dict()},
                replica={"feed": self.feed.state_dict()},
                rank={"torch_rng": torch.get_rng_state()},
            ),
            meta={
                "stages": self._stage_counts(),
                "tokens": self.tokens,
                "vocab_size": self.cfg.data.vocab_size,
                "config": to_dict(self.cfg),
                "reason": reason,
                "slurm_job": self.slurm_job,  # a requeued job started with --resume none continues its own saves
                "time": time.time(),
                "best": best,
            },
            keep_last=self.cfg.train.keep_last,
            tokenizer=self.tokenizer,
        )
        self.log(f"checkpoint: saved {path} ({reason})")
        return path

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
        """Train to ``train.max_steps``; returns the process exit status."""
        t = self.cfg.train
        self.engine.train()
        if (nothing_left := self._nothing_left()) is not None:
            self.log(f"train: nothing to train: {nothing_left}")
        logger = MetricsLogger(self.run_dir, self.ctx.is_main, t.max_steps)
        watch = SignalWatch(self.slurm_job)
        start_step = self.engine.global_steps
        self._last_save = time.monotonic()
        window = Window()
        profiler = StepProfiler(
            t.profile_from, t.profile_steps, self.run_dir / "profile", self.ctx.rank, self.ctx.device, self.log
        )
        try:
            while nothing_left is None and self.engine.global_steps < t.max_steps and not self._cooled():
                time_up = t.max_minutes > 0 and self.train_seconds >= 60 * t.max_minutes
                cool = cooldown_time_reached(t.cooldown_fraction, self.train_seconds, t.max_minutes)
                # Each rank reads its own clock: a save is due when any rank's says so, decided
                # with the step's flags so that every rank enters the save's collectives.
                save_due = t.save_minutes > 0 and time.monotonic() - self._last_save >= 60 * t.save_minutes
                began = time.perf_counter()
                flags = StepFlags(watch.received == REQUEUE, watch.received == TERMINATE, time_up, save_due, cool)
                with profiler.step(self.engine.global_steps + 1):
                    loss_sum, tokens, world = self.step(flags)
                usr1, term, up, due, cool = world.usr1, world.term, world.time_up, world.save_due, world.cooldown
                seconds = time.perf_counter() - began
                self.train_seconds += seconds
                self.tokens += int(tokens)
                window.add(loss_sum, tokens, seconds)
                signal = TERMINATE if term else REQUEUE if usr1 else NONE
                self._fit_warmup()
                cooled = self._cool_down(bool(cool))
                end = "time limit" if up else "cool-down" if cooled else None
                self._after_step(logger, window, signal, end, bool(due), watch.stopped_by)
                step = self.engine.global_steps
                if signal == REQUEUE:
                    watch.note_requeue()
                    accepted = requeue(self.slurm_job, step > start_step, self.log) if self.ctx.is_main else False
                    self.log(f"train: stopping at step {step} after SIGUSR1 ({'' if accepted else 'not '}requeued)")
                    return 0
                if signal == TERMINATE:  # a peer's SIGTERM is this rank's too; Ctrl-C reaches every rank
                    self.log(f"train: stopping at step {step} after {watch.stopped_by} (saved)")
                    return watch.exit_status
                if up:
                    self.log(f"train: train.max_minutes={t.max_minutes} reached at step {self.engine.global_steps}")
                    break
                if cooled:
                    self.log(f"train: the cool-down ended at step {self.engine.global_steps}")
                    break
            step = self.engine.global_steps
            # Only a run resumed at its last step, saved there on a signal, gets here unvalidated: saved again, validated.
            if t.eval_interval and step % t.eval_interval and self._validated != step:
                self.save("best" if (best := self._validate(logger, step)) else "validated", best=best)
        finally:
            watch.restore()
            logger.close()
            self.feed.close()
        return 0

    def _nothing_left(self) -> str | None:
        """Why a (resumed) run has no step left to train; the same on every rank (the run's state)."""
        cooled_at = self.engine.cooldown.end if self._cooled() else None
        return nothing_left_to_train(self.cfg.train, self.engine.global_steps, cooled_at, self.train_seconds)

    def _cool_down(self, time_reached: bool) -> bool:
        """Begin the cool-down when it is due; True when it has ended (the run ends with it).

        ``time_reached`` is the world's, and the update count is the same on every rank:
        every rank begins it at the same update, with the same length.
        """
        t, updates = self.cfg.train, self.engine.optimizer_steps
        if self.engine.cooldown is None:
            budget = self.budget
            expected_left = budget.steps_left(self.engine.global_steps, self.world_seconds) if time_reached else None
            cooldown = cooldown_start(t.cooldown_fraction, updates, t.max_steps, time_reached, expected_left)
            if cooldown is None:
                return False
            self.engine.set_cooldown(cooldown)
            self.log(
                f"train: train.cooldown_fraction={t.cooldown_fraction}: after update {updates}, the lr ramps down "
                f"to 0 over the next {cooldown.length} updates (from {self.engine.lr():.3g})"
            )
        return self._cooled()

    def _fit_warmup(self) -> None:
        """Fit the warm-up to the steps the time budget is expected to reach (train.warmup_fraction).

        The step, the update count and the world's mean training time are the same on every
        rank, so every rank fits the same warm-up at the same update.
        """
        step, updates = self.engine.global_steps, self.engine.optimizer_steps
        fitted = self.budget.fit(step, updates, self.world_seconds, self.engine.warmup)
        if fitted is None:
            if self._warmup_said is not None and updates == self.engine.warmup:  # refits move it by < 10 % unsaid
                self._warmup_said = None
                self.log(
                    f"train: the warm-up ended at update {updates:,} (train.warmup_fraction), lr {self.engine.lr():.3g}"
                )
            return
        said = self._warmup_said
        self.engine.set_warmup(fitted)
        if said is None or abs(fitted - said) > 0.1 * said:
            self._warmup_said = fitted
            t = self.cfg.train
            expected = self.budget.expected_steps(step, self.world_seconds)
            bound = (
                f"train.max_steps={t.max_steps:,}"
                if expected == t.max_steps
                else f"train.max_minutes={t.max_minutes:g}"
            )
            self.log(
                f"train: train.warmup_fraction={t.warmup_fraction:g}: ~{expected:,} steps expected in {bound}; "
                f"the warm-up ends at update {fitted:,}"
            )

    def _cooled(self) -> bool:
        cooldown = self.engine.cooldown
        return cooldown is not None and self.engine.optimizer_steps >= cooldown.end

    def _after_step(
        self,
        logger: MetricsLogger,
        window: Window,
        signal: int,
        end: str | None,
        minutes_due: bool,
        stopped_by: str = "SIGTERM",
    ) -> None:
        """Log, validate and save as scheduled (and on a signal, the time limit or the cool-down's end).

        ``signal``, ``end`` (why the run ends here, or None) and ``minutes_due``
        (``train.save_minutes`` passed) are the world's: every rank takes the same branch here;
        ``stopped_by`` names the signal a TERMINATE came from (this rank's view, for the save's reason).
        """
        t, step = self.cfg.train, self.engine.global_steps
        if step % t.log_interval == 0 or step == t.max_steps:
            self._log(logger, window)
            window.reset()
        last = signal == NONE and (end is not None or step == t.max_steps)  # validated before the last save
        best = bool(t.eval_interval) and (step % t.eval_interval == 0 or last) and self._validate(logger, step)
        scheduled = t.save_interval and step % t.save_interval == 0
        due = signal != NONE or end is not None or step == t.max_steps or minutes_due or scheduled
        if due or best:
            reason = {TERMINATE: stopped_by, REQUEUE: "SIGUSR1"}.get(signal, end or "schedule")
            self.save(reason if due else "best", best=best)
            self._last_save = time.monotonic()

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
