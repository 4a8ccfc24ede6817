"""The training loop: steps, validation, logging, checkpoints on schedule and on signals.

One optimizer step: take this rank's micro-batches (:class:`DataFeed`), sum their
target tokens over the DP group, and back-propagate each micro-batch's *summed* loss
scaled by ``accumulation x dp / tokens``. DeepSpeed divides by the accumulation steps
and averages over DP, so the update is the gradient of the mean loss per target token
of the whole step: two micro-batches give exactly the update of one double batch, and
ranks with more tokens weigh more, as they should.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megaformer.config import Config, dump_config, to_dict
from megaformer.data.shards import manifest_path, read_manifest
from megaformer.data.stream import TokenBatchStream, open_prepared
from megaformer.errors import ConfigError
from megaformer.info import model_info
from megaformer.model import Transformer
from megaformer.parallel import DropoutRNG, ParallelContext
from megaformer.train import checkpoint as ckpt
from megaformer.train.engine import Engine, adam_step, build_engine, export_state, import_state
from megaformer.train.feed import DataFeed, stream_count
from megaformer.train.metrics import MetricsLogger, device_peak_flops
from megaformer.train.signals import EXIT_TERMINATED, NONE, REQUEUE, TERMINATE, SignalWatch, requeue


def accumulate(engine: Engine, batches, tokens: float, label_smoothing: float) -> float:
    """Back-propagate each micro-batch of one optimizer step and step; returns this rank's summed loss.

    ``tokens``: the step's target tokens summed over the DP group. Each micro-batch's
    summed loss is scaled by ``accumulation x dp / tokens``: DeepSpeed divides by the
    accumulation steps and averages over DP, so the update follows the mean loss per
    target token of the whole step.
    """
    ds = engine.ds
    scale = engine.accumulation * engine.ctx.dp_size / tokens
    loss_sum, done = 0.0, 0
    for batch in batches:
        b = batch.to(engine.ctx.device)
        loss, _ = engine.module.loss(b.src, b.tgt_in, b.tgt_out, label_smoothing)
        ds.backward(loss * scale)
        done += 1
        if done == engine.accumulation:
            engine.note_grad_norm()
        ds.step()
        loss_sum += loss.item()
    if done != engine.accumulation:
        raise RuntimeError(f"{done} micro-batches for an accumulation of {engine.accumulation}")
    return loss_sum


class Trainer:
    def __init__(self, cfg: Config, ctx: ParallelContext, run_dir: Path, resume: str = "auto") -> None:
        self.cfg, self.ctx, self.run_dir = cfg, ctx, Path(run_dir)
        self.log = print if ctx.is_main else (lambda *a, **k: None)
        if not cfg.data.path:
            raise ConfigError("data.path is empty: set it to a directory written by `megaformer prepare`")
        manifest = read_manifest(manifest_path(cfg.data.path))
        cfg.data.vocab_size = int(manifest["tokenizer"]["vocab_size"])
        self.tokenizer = open_prepared(cfg.data.path, "train").tokenizer_path
        self.has_valid = "valid" in manifest["splits"]

        self.start_dir = self._resume_point(resume)
        saved = ckpt.read_meta(self.start_dir) if self.start_dir else None
        if ctx.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            dump_config(cfg, self.run_dir / "config.yaml")

        t = cfg.train
        self.rng = DropoutRNG(t.seed, ctx.tp, ctx.dp_rank, cfg.parallel.dropout_rng, device=ctx.device)
        self.model = Transformer(
            cfg.model,
            cfg.data.vocab_size,
            ctx.tp,
            self.rng,
            seed=t.seed,
            sequence_parallel=cfg.parallel.sequence_parallel,
            vocab_multiple=cfg.parallel.vocab_multiple,
        ).to(ctx.device)
        streams = stream_count(saved["data_streams"] if saved else None, ctx.dp_size)
        per_stream = max(1, round(t.tokens_per_step / (streams * cfg.data.max_tokens)))
        self.feed = DataFeed(
            self._stream, streams, ctx.dp_rank, ctx.dp_size, per_stream, self.rng, t.seed, cfg.parallel.dropout_rng
        )
        self.engine: Engine = build_engine(cfg, ctx, self.model, self.feed.accumulation)
        self.parameters = model_info(cfg)["parameters"]
        # The peak of all devices together. On a CPU every rank measures at the same time (as
        # they train): ranks that share cores then measure the share they really get.
        if dist.is_initialized():
            dist.barrier()
        self.peak = self._world_sum([device_peak_flops(ctx.device, t.precision, t.peak_tflops)])[0]
        self.tokens = 0
        self.train_seconds = 0.0
        if saved:
            self._load(self.start_dir)
        self.log(
            f"train: {self.parameters / 1e6:.1f}M parameters, tp={ctx.layout.tp} dp={ctx.layout.dp} "
            f"zero={t.zero_stage} {t.precision}, {self.feed.accumulation} micro-batches of <= "
            f"{cfg.data.max_tokens} tokens per rank per step ({streams} data streams), run dir {self.run_dir}"
        )

    # ---- set-up ---------------------------------------------------------------------------

    def _resume_point(self, resume: str) -> Path | None:
        if resume == "none":
            return None
        if resume == "auto":
            found = ckpt.find_latest(self.run_dir, log=self.log)
            if found is None:
                self.log(f"train: no checkpoint under {self.run_dir}, starting from scratch")
            return found
        return ckpt.resolve_checkpoint(resume, log=self.log)

    def _stream(self, index: int, count: int, split: str = "train") -> TokenBatchStream:
        d = self.cfg.data
        training = split == "train"
        return TokenBatchStream(
            d.path,
            split,
            dp_rank=index,
            dp_size=count,
            max_tokens=d.max_tokens,
            num_workers=d.num_workers,
            shuffle_buffer=d.shuffle_buffer,
            sort_buffer=d.sort_buffer,
            seed=d.seed,
            max_len=d.max_len,
            shuffle=training,
            repeat=training,
        )

    def _load(self, step_dir: Path) -> None:
        meta, state, rank_state = ckpt.load_checkpoint_state(step_dir, self.ctx, self.model)
        import_state(self.engine, state, meta["optimizer_steps"])
        ds = self.engine.ds
        ds.global_steps, ds.skipped_steps = meta["step"], meta["skipped_steps"]
        ds.global_samples = meta["step"] * self.feed.accumulation * self.ctx.dp_size
        scaler = getattr(ds.optimizer, "loss_scaler", None)
        for name, value in meta.get("loss_scaler", {}).items():
            if scaler is not None and hasattr(scaler, name):
                setattr(scaler, name, value)
        self.feed.load(meta["data_states"], local_rng=rank_state.get("local_rng") if rank_state else None)
        if rank_state is not None:
            torch.set_rng_state(rank_state["torch_rng"])
        self.tokens, self.train_seconds = meta["tokens"], meta.get("train_seconds", 0.0)
        same = meta["layout"] == {
            "tp": self.ctx.layout.tp,
            "dp": self.ctx.layout.dp,
            "world": self.ctx.layout.world_size,
        }
        self.log(
            f"train: resumed from {step_dir} (step {meta['step']}, {meta['tokens']:,} target tokens"
            f"{'' if same else ', layout tp={tp} dp={dp} -> tp={t} dp={d}'.format(**meta['layout'], t=self.ctx.layout.tp, d=self.ctx.layout.dp)})"
        )

    # ---- checkpoints ------------------------------------------------------------------------

    def save(self, reason: str) -> Path:
        ds = self.engine.ds
        scaler = getattr(ds.optimizer, "loss_scaler", None)
        scaler_state = {
            k: getattr(scaler, k)
            for k in ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
            if scaler is not None and hasattr(scaler, k)
        }
        scaler_state = {k: (v.item() if torch.is_tensor(v) else v) for k, v in scaler_state.items()}
        path = ckpt.save_checkpoint(
            self.run_dir / "checkpoints",
            ds.global_steps,
            self.ctx,
            model_state=export_state(self.engine),
            rank_state={"torch_rng": torch.get_rng_state(), "local_rng": self.feed.local_rng_state()},
            data_state=self.feed.state(),
            meta={
                "optimizer_steps": adam_step(self.engine),
                "skipped_steps": ds.skipped_steps,
                "tokens": self.tokens,
                "train_seconds": self.train_seconds,
                "vocab_size": self.cfg.data.vocab_size,
                "data_streams": self.feed.streams,
                "loss_scaler": scaler_state,
                "config": to_dict(self.cfg),
                "reason": reason,
                "time": time.time(),
            },
            keep_last=self.cfg.train.keep_last,
            tokenizer=self.tokenizer,
        )
        self.log(f"checkpoint: saved {path} ({reason})")
        return path

    # ---- the loop ---------------------------------------------------------------------------

    def _world_sum(self, values: list[float]) -> list[float]:
        """Sum over every rank; TP peers hold equal values, so a DP sum is this divided by tp."""
        t = torch.tensor(values, dtype=torch.float64, device=self.ctx.device)  # nccl reduces device tensors only
        if dist.is_initialized():
            dist.all_reduce(t)
        return t.tolist()

    def step(self, flags: list[float]) -> tuple[float, float, list[float]]:
        """One optimizer step: (this rank's summed loss, the step's DP target tokens, world-summed flags).

        A single all-reduce per step carries the token count and the flags (signals received,
        time up), so that every rank stops at the same step.
        """
        micro = self.feed.next_step()
        local = float(sum(m.batch.tgt_tokens for m in micro))
        reduced = self._world_sum([local] + flags)
        tokens, flags = reduced[0] / self.ctx.layout.tp, reduced[1:]

        def batches():
            for m in micro:
                self.feed.use_rng_of(m.stream)  # the dropout masks of the stream the batch came from
                yield m.batch
                self.feed.save_rng_of(m.stream)

        loss_sum = accumulate(self.engine, batches(), tokens, self.cfg.train.label_smoothing)
        return loss_sum, tokens, flags

    @torch.no_grad()
    def validate(self) -> dict | None:
        """Validation loss (label-smoothed, as trained) and perplexity (plain NLL) over the valid split."""
        if not self.has_valid:
            return None
        from megaformer.parallel import vocab_parallel_cross_entropy

        self.model.eval()
        stream = self._stream(self.ctx.dp_rank, self.ctx.dp_size, "valid")
        sums = [0.0, 0.0, 0.0]
        for batch in stream:
            b = batch.to(self.ctx.device)
            logits = self.model(b.src, b.tgt_in).flatten(0, 1)
            target = b.tgt_out.flatten()
            args = (target, self.ctx.tp, self.cfg.data.vocab_size)
            sums[0] += vocab_parallel_cross_entropy(logits, *args, self.cfg.train.label_smoothing, 0).sum().item()
            sums[1] += vocab_parallel_cross_entropy(logits, *args, 0.0, 0).sum().item()
            sums[2] += b.tgt_tokens
        self.model.train()
        loss, nll, tokens = (v / self.ctx.layout.tp for v in self._world_sum(sums))
        return {
            "loss": loss / tokens,
            "nll": nll / tokens,
            "ppl": math.exp(min(nll / tokens, 50.0)),
            "tokens": int(tokens),
        }

    def train(self) -> int:
        """Train to ``train.max_steps``; returns the process exit status."""
        t = self.cfg.train
        ds = self.engine.ds
        ds.train()
        logger = MetricsLogger(self.run_dir, self.ctx.is_main, t.max_steps)
        watch = SignalWatch()
        start_step = ds.global_steps
        last_save = time.monotonic()
        window = {"loss": 0.0, "tokens": 0.0, "seconds": 0.0, "steps": 0}
        status = 0
        try:
            while ds.global_steps < t.max_steps:
                time_up = t.max_minutes > 0 and self.train_seconds >= 60 * t.max_minutes
                began = time.perf_counter()
                loss_sum, tokens, (usr1, term, up) = self.step(
                    [float(watch.received == REQUEUE), float(watch.received == TERMINATE), float(time_up)]
                )
                seconds = time.perf_counter() - began
                self.train_seconds += seconds
                self.tokens += int(tokens)
                window["loss"] += loss_sum
                window["tokens"] += tokens
                window["seconds"] += seconds
                window["steps"] += 1
                step = ds.global_steps
                if step % t.log_interval == 0 or step == t.max_steps:
                    self._log(logger, window)
                    window = {"loss": 0.0, "tokens": 0.0, "seconds": 0.0, "steps": 0}
                if t.eval_interval and step % t.eval_interval == 0:
                    self._validate(logger, step)
                signal = TERMINATE if term else REQUEUE if usr1 else NONE
                minutes_due = t.save_minutes > 0 and time.monotonic() - last_save >= 60 * t.save_minutes
                if (
                    signal != NONE
                    or up
                    or step == t.max_steps
                    or minutes_due
                    or (t.save_interval and step % t.save_interval == 0)
                ):
                    reason = {TERMINATE: "SIGTERM", REQUEUE: "SIGUSR1"}.get(signal, "time limit" if up else "schedule")
                    self.save(reason)
                    last_save = time.monotonic()
                if signal == REQUEUE:
                    accepted = requeue(step > start_step, self.log) if self.ctx.is_main else False
                    self.log(
                        f"train: stopping at step {step} after SIGUSR1 ({'requeued' if accepted else 'not requeued'})"
                    )
                    return 0
                if signal == TERMINATE:
                    self.log(f"train: stopping at step {step} after SIGTERM (saved, not requeued)")
                    return EXIT_TERMINATED
                if up:
                    self.log(f"train: train.max_minutes={t.max_minutes} reached at step {step}")
                    break
            if t.eval_interval and ds.global_steps % t.eval_interval:  # not validated at this step yet
                self._validate(logger, ds.global_steps)
        finally:
            watch.restore()
            logger.close()
        return status

    def _log(self, logger: MetricsLogger, window: dict) -> None:
        loss_sum = self._world_sum([window["loss"]])[0] / self.ctx.layout.tp
        tokens_per_s = window["tokens"] / max(window["seconds"], 1e-9)
        record = {
            "step": self.engine.ds.global_steps,
            "loss": loss_sum / max(window["tokens"], 1.0),
            "lr": self.engine.lr(),
            "grad_norm": self.engine.grad_norm(),
            "loss_scale": self.engine.loss_scale(),
            "tokens": self.tokens,
            "tokens_per_s": tokens_per_s,
            "mfu": 6 * self.parameters * tokens_per_s / self.peak,
            "epoch": self.feed.epoch(),
            "skipped_steps": self.engine.ds.skipped_steps,
            "train_seconds": self.train_seconds,
        }
        logger.log(record)
        logger.console(record)

    def _validate(self, logger: MetricsLogger, step: int) -> None:
        result = self.validate()
        if result is None:
            return
        logger.log({"step": step, **result}, prefix="valid")
        self.log(f"valid  {step:>6d} | loss {result['loss']:.4f} | nll {result['nll']:.4f} | ppl {result['ppl']:.2f}")
