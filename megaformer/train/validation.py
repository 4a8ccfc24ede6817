"""Validation during training: the loss and perplexity over the valid split, and greedy BLEU on a sample.

Every ``train.eval_interval`` steps (and at the last step) the trainer asks
:class:`Validation` for the label-smoothed loss (as trained) and the plain NLL over the
whole valid split, summed over every rank; with a BLEU sample
(:mod:`megaformer.train.valid_bleu`), also greedy BLEU on its first
``train.eval_bleu_sentences`` sentences. A pipeline's last stage computes the sums, the
other stages add nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from megaformer.config import Config
from megaformer.data.stream import TokenBatchStream
from megaformer.decode.beam import SearchSettings
from megaformer.decode.evaluate import moses_languages
from megaformer.errors import ConfigError
from megaformer.model import Transformer
from megaformer.parallel import ParallelContext, vocab_parallel_cross_entropy
from megaformer.pipeline.schedule import Pipeline
from megaformer.pipeline.stage import StageBatch
from megaformer.train.valid_bleu import BleuSample, bleu_skip_reason, load_bleu_sample, sample_bleu


class Validation:
    """The run's validation: built once (the BLEU sample read, or why not said once), run as scheduled."""

    def __init__(
        self,
        cfg: Config,
        ctx: ParallelContext,
        model: Transformer,
        pipeline: Pipeline | None,
        stream: Callable[..., TokenBatchStream],
        has_valid: bool,
        log: Callable[[str], None],
    ) -> None:
        self.cfg, self.ctx, self.model, self.pipeline, self.stream = cfg, ctx, model, pipeline, stream
        self.has_valid = has_valid
        if has_valid and cfg.train.eval_interval:  # a split it cannot stream: refused now, not at the first validation
            stream(ctx.dp_rank, ctx.dp_size, "valid")
        self.bleu_sample = self._bleu_sample(log)

    def _bleu_sample(self, log: Callable[[str], None]) -> BleuSample | None:
        """The valid sentences BLEU is computed on during training, or None (said once, with the reason)."""
        cfg = self.cfg
        if not cfg.train.eval_interval:
            return None
        reason = bleu_skip_reason(
            cfg.train.eval_bleu_sentences, self.has_valid, self.ctx.pp_size, self.model.sequence_parallel
        )
        sample = None
        if reason is None:
            sample = load_bleu_sample(cfg.data.path, cfg.train.eval_bleu_sentences, cfg.model.max_positions)
            reason = None if sample.sources else "the valid split holds no sentences"
        n = len(sample.sources) if sample is not None else 0
        if reason is None and cfg.train.eval_bleu_tokenized and cfg.data.tgt_lang not in moses_languages():
            raise ConfigError(
                f"train.eval_bleu_tokenized=true: the Moses tokenizer has no language {cfg.data.tgt_lang!r} (the "
                f"data's target); set train.eval_bleu_tokenized=false"
            )
        log(f"train: validation BLEU {'off: ' + reason if reason else f'on {n} sentence' + 's' * (n != 1)}")
        return sample if reason is None else None

    @torch.no_grad()
    def run(self) -> dict | None:
        """Validation loss (label-smoothed, as trained) and perplexity (plain NLL) over the valid split."""
        if not self.has_valid:
            return None
        cfg, ctx, model = self.cfg, self.ctx, self.model
        model.eval()
        pad_id, sums = model.pad_id, [0.0, 0.0, 0.0]
        for batch in self.stream(ctx.dp_rank, ctx.dp_size, "valid"):
            b = batch.to(ctx.device)
            padded = StageBatch.of(b.src, b.tgt_in, b.tgt_out, model)  # sequence parallelism splits evenly
            if self.pipeline is None:
                logits = model(padded.src, padded.tgt_in)
            elif (logits := self.pipeline.forward_only(padded)) is None:
                continue  # not the last stage: it adds nothing, the last stage's TP ranks add the sums
            logits = logits.flatten(0, 1)
            args = (padded.tgt_out.flatten(), ctx.tp, cfg.data.vocab_size)
            smoothed = vocab_parallel_cross_entropy(logits, *args, cfg.train.label_smoothing, pad_id).sum()
            nll = vocab_parallel_cross_entropy(logits, *args, 0.0, pad_id).sum()
            sums[0] += smoothed.item()
            sums[1] += nll.item()
            sums[2] += b.tgt_tokens
        total = torch.tensor(sums, dtype=torch.float64, device=ctx.device)  # nccl reduces device tensors only
        if dist.is_initialized():
            dist.all_reduce(total, group=ctx.world_group)
        loss, nll, tokens = (v / ctx.layout.tp for v in total.tolist())  # TP peers each added the same sums
        ppl = math.exp(min(nll / tokens, 50.0))
        result = {"loss": loss / tokens, "nll": nll / tokens, "ppl": ppl, "tokens": int(tokens)}
        if self.bleu_sample is not None:
            settings = SearchSettings.from_config(cfg.decode, beam=1)
            lang = cfg.data.tgt_lang if cfg.train.eval_bleu_tokenized else None
            result |= sample_bleu(model, self.bleu_sample, settings, cfg.decode.max_tokens, ctx, lang)
        model.train()
        return result
