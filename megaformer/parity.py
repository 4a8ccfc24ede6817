"""A TP=N model against the TP=1 model from the same seed (``megaformer parity``).

Builds the tensor-parallel model and an unsplit reference from one seed, runs
forward and backward on a fixed random batch with dropout on, and prints the largest
differences of the loss, the logits and every gradient (gathered to full size). Exits
non-zero beyond tolerance. On a laptop it starts N gloo processes itself; under
torchrun, srun or the DeepSpeed launcher it uses the processes it was given.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from megaformer.config import Config
from megaformer.data.tokenizer import EOS_ID, PAD_ID
from megaformer.errors import ConfigError
from megaformer.logs import configure as configure_logs
from megaformer.logs import set_rank
from megaformer.parallel import (
    LOCAL,
    DropoutRNG,
    ParallelContext,
    ParallelLayout,
    TPGroup,
    check_model_split,
    gather_from_tp,
    gather_full,
    tp_dim,
    tp_partitions,
)
from megaformer.parallel.stages import StagePart

LOG = logging.getLogger(__name__)


@dataclass
class ParityReport:
    loss: float
    reference_loss: float
    diffs: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (max abs diff, relative)

    def worst(self) -> tuple[str, float]:
        name = max(self.diffs, key=lambda k: self.diffs[k][1])
        return name, self.diffs[name][1]


def _relative(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    diff = (a.double() - b.double()).abs().max().item()
    scale = b.double().abs().max().item()
    return diff, diff / scale if scale > 0 else diff


def random_batch(
    vocab_size: int, batch: int, src_len: int, tgt_len: int, seed: int, pad_id: int = PAD_ID, first_id: int = EOS_ID + 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fixed batch whose rows have different lengths (right-padded), ids in [first_id, vocab)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(first_id, vocab_size, (batch, src_len), generator=g)
    tgt = torch.randint(first_id, vocab_size, (batch, tgt_len + 1), generator=g)
    for row in range(1, batch):  # row 0 keeps the full length
        src[row, src_len - row % src_len :] = pad_id
        tgt[row, tgt_len + 1 - row % tgt_len :] = pad_id
    return src, tgt[:, :-1].clone(), tgt[:, 1:].clone()


def _build(
    cfg: Config, tp: TPGroup, sequence_parallel: bool, device: torch.device, part: StagePart | None = None
) -> torch.nn.Module:
    """The model (or pipeline stage ``part``) of ``cfg`` at ``tp``, from the config's seed (the same at every size)."""
    from megaformer.model import Transformer

    rng = DropoutRNG(cfg.train.seed, tp, 0, cfg.parallel.dropout_rng)
    return Transformer(
        cfg.model,
        cfg.data.vocab_size,
        tp,
        rng,
        seed=cfg.train.seed,
        sequence_parallel=sequence_parallel,
        vocab_multiple=cfg.parallel.vocab_multiple,
        part=part,
    ).to(device)


def _pipeline_loss_and_grads(
    cfg: Config, ctx: ParallelContext, micro: list[tuple[torch.Tensor, ...]], tokens: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This rank's stage through one 1F1B step of ``micro``: the loss (summed over stages) and its gathered grads."""
    import torch.distributed as dist

    from megaformer.parallel.stages import plan_stages
    from megaformer.pipeline.schedule import Pipeline, PipeMicroBatch
    from megaformer.pipeline.stage import StageBatch

    parts = plan_stages(cfg.model, ctx.pp_size, cfg.parallel.pp_split, cfg.data.vocab_size)
    model = _build(cfg, ctx.tp, cfg.parallel.sequence_parallel, ctx.device, parts[ctx.pp_rank])
    model.train()
    pipeline = Pipeline(ctx, model, parts)
    pipeline.sync_embedding()
    base = model.rng.state_dict()
    batches = [PipeMicroBatch(StageBatch.of(*m, model), pipeline.dropout_state(base, k)) for k, m in enumerate(micro)]
    loss = pipeline.train_step(batches, 1.0 / tokens, cfg.train.label_smoothing, lambda x, _: x.backward(), 1.0)
    loss = loss / tokens
    dist.all_reduce(loss, group=ctx.pp_group)  # only the last stage's is not 0
    grads = {n: gather_full(p.grad, tp_dim(p), tp_partitions(p), ctx.tp) for n, p in model.named_parameters()}
    every: list[dict | None] = [None] * ctx.layout.world_size
    dist.all_gather_object(every, {n: g.cpu() for n, g in grads.items()}, group=ctx.world_group)
    merged = {n: g for stage in every for n, g in stage.items()}  # TP peers hold equal gathered copies
    return loss.detach(), merged


def _reference_micro_batches(
    ref: torch.nn.Module, micro: list[tuple[torch.Tensor, ...]], tokens: int, smoothing: float
) -> torch.Tensor:
    """The unsplit model over the same micro-batches in order, as gradient accumulation runs them."""
    ref.train()
    total = torch.zeros(())
    for src, tgt_in, tgt_out in micro:
        loss, _ = ref.loss(src, tgt_in, tgt_out, smoothing)
        (loss / tokens).backward()
        total = total + loss.detach().cpu()
    return total / tokens


def _loss_and_logits(
    model: torch.nn.Module, batch: tuple[torch.Tensor, ...], smoothing: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean loss (backward run, dropout on) and the logits of the same forward, replaying its masks."""
    src, tgt_in, tgt_out = batch
    start = model.rng.state_dict()
    model.train()
    total, ntok = model.loss(src, tgt_in, tgt_out, smoothing)
    (total / ntok).backward()
    with torch.no_grad(), model.rng.fork(start):
        logits = model(src, tgt_in)
    return (total / ntok).detach(), logits


def check_parity(
    cfg: Config,
    ctx: ParallelContext,
    batch: int = 4,
    src_len: int = 24,
    tgt_len: int = 12,
    micro_batches: int = 4,
) -> ParityReport | None:
    """Compare the TP model of ``ctx`` with a TP=1 model; every rank calls this, rank 0 gets the report.

    Only rank 0 builds and runs the reference. Sequence lengths should be multiples of
    the TP size when sequence parallelism is on, so that both models see the same
    (unpadded) shapes and therefore the same dropout masks.
    """
    tp_size = ctx.tp.size
    if cfg.parallel.sequence_parallel and (src_len % tp_size or tgt_len % tp_size):
        raise ConfigError(
            f"with sequence parallelism the parity batch lengths must be multiples of tp={tp_size}; "
            f"got --src-len {src_len} --tgt-len {tgt_len}"
        )
    vocab = cfg.data.vocab_size
    smoothing = cfg.train.label_smoothing
    device = ctx.device
    src, tgt_in, tgt_out = (t.to(device) for t in random_batch(vocab, batch, src_len, tgt_len, cfg.train.seed))
    if ctx.pp_size > 1:
        return _check_pipeline_parity(cfg, ctx, (src, tgt_in, tgt_out), micro_batches)

    batch_on_device = (src, tgt_in, tgt_out)
    model = _build(cfg, ctx.tp, cfg.parallel.sequence_parallel, device)
    loss, logits = _loss_and_logits(model, batch_on_device, smoothing)
    logits = gather_from_tp(logits, ctx.tp)
    grads = {n: gather_full(p.grad, tp_dim(p), tp_partitions(p), ctx.tp) for n, p in model.named_parameters()}
    if ctx.rank != 0:
        return None

    ref = _build(cfg, LOCAL, False, device)
    ref_loss, ref_logits = _loss_and_logits(ref, batch_on_device, smoothing)
    report = ParityReport(loss.item(), ref_loss.item())
    report.diffs["loss"] = _relative(loss, ref_loss)
    real = slice(0, vocab)
    report.diffs["logits"] = _relative(logits[..., real], ref_logits[..., real])
    for name, p in ref.named_parameters():
        report.diffs[f"grad {name}"] = _relative(grads[name], p.grad)
    return report


def _check_pipeline_parity(
    cfg: Config, ctx: ParallelContext, batch: tuple[torch.Tensor, ...], micro_batches: int
) -> ParityReport | None:
    """The PP (x TP) pipeline over ``micro_batches`` slices of ``batch`` against the unsplit model over the same."""
    check_micro_batches(micro_batches, batch[0].shape[0])
    micro = [tuple(t.tensor_split(micro_batches)[k] for t in batch) for k in range(micro_batches)]
    tokens = int(batch[2].ne(PAD_ID).sum())
    loss, grads = _pipeline_loss_and_grads(cfg, ctx, micro, tokens)
    if ctx.rank != 0:
        return None
    ref = _build(cfg, LOCAL, False, ctx.device)
    ref_loss = _reference_micro_batches(ref, micro, tokens, cfg.train.label_smoothing)
    report = ParityReport(loss.item(), ref_loss.item())
    report.diffs["loss"] = _relative(loss.cpu(), ref_loss)
    for name, p in ref.named_parameters():
        if name not in grads:
            raise RuntimeError(f"no pipeline stage holds {name}")
        report.diffs[f"grad {name}"] = _relative(grads[name], p.grad.cpu())
    return report


def check_micro_batches(micro_batches: int, rows: int) -> None:
    if micro_batches > rows:
        raise ConfigError(f"--micro-batches {micro_batches} is more than the --batch {rows} rows to cut")


@dataclass(frozen=True)
class ParitySettings:
    """One ``parity`` check: the random batch, its micro-batches (with ``parallel.pp > 1``), what is accepted and shown.

    ``tolerance`` is the largest relative difference accepted; ``show_all`` prints every
    gradient, not only the worst ten.
    """

    batch: int = 4
    src_len: int = 24
    tgt_len: int = 12
    micro_batches: int = 4
    tolerance: float = 1e-5
    show_all: bool = False


def _print_report(report: ParityReport, cfg: Config, settings: ParitySettings, backend: str) -> bool:
    """The differences, largest first, and PASS or FAIL; True when within ``settings.tolerance``."""
    rows = sorted(report.diffs.items(), key=lambda kv: -kv[1][1])
    shown = (
        rows
        if settings.show_all
        else [r for r in rows if not r[0].startswith("grad")] + [r for r in rows if r[0].startswith("grad")][:10]
    )
    layout = f"TP={cfg.parallel.tp} PP={cfg.parallel.pp}" if cfg.parallel.pp > 1 else f"TP={cfg.parallel.tp}"
    cut = f", {settings.micro_batches} micro-batches, pp_split={cfg.parallel.pp_split or 'balanced'}"
    precision = "fp32" + (f", not train.precision={cfg.train.precision}" if cfg.train.precision != "fp32" else "")
    LOG.info(
        f"parity {layout} vs TP=1{cut if cfg.parallel.pp > 1 else ''} ({precision}, "
        f"sequence_parallel={cfg.parallel.sequence_parallel and cfg.parallel.tp > 1}, "
        f"dropout={cfg.model.dropout}, dropout_rng={cfg.parallel.dropout_rng}, backend={backend})"
    )
    LOG.info(f"loss: {layout} {report.loss:.8f}  TP=1 {report.reference_loss:.8f}")
    LOG.info(f"{'tensor':60s} {'max abs diff':>14s} {'relative':>12s}")
    for name, (diff, rel) in shown:
        LOG.info(f"{name:60s} {diff:14.3e} {rel:12.3e}")
    name, worst = report.worst()
    ok = worst <= settings.tolerance
    LOG.info(
        f"{'PASS' if ok else 'FAIL'}: largest relative difference {worst:.3e} ({name}), tolerance "
        f"{settings.tolerance:.0e} over {sum(k.startswith('grad') for k in report.diffs)} gradients"
    )
    return ok


def _rank_main(cfg: Config, settings: ParitySettings) -> int:
    """One rank of :func:`run_parity`; rank 0 prints the report. 0 within tolerance, 1 beyond."""
    from launcher.env import detect  # the rank, world size and master port the launcher set, checked

    info = detect()
    configure_logs()  # at the level the starting process chose (its environment)
    set_rank(info.rank)
    ctx = ParallelContext.initialize(cfg.parallel, info.rank, info.world_size, info.local_rank)
    try:
        s = settings
        report = check_parity(cfg, ctx, s.batch, s.src_len, s.tgt_len, s.micro_batches)
        if report is None:
            return 0
        return 0 if _print_report(report, cfg, settings, ctx.backend) else 1
    finally:
        ctx.destroy()


def run_parity(cfg: Config, settings: ParitySettings) -> int:
    """Check ``cfg``'s layout (TP x PP ranks) against TP=1: in this launch's processes, or in as many started here.

    ``cfg.model.activation_checkpointing`` is switched off (``cfg`` is changed in place).
    Under torchrun, srun or the DeepSpeed launcher the launch must have exactly tp x pp processes.
    """
    world = cfg.parallel.tp * cfg.parallel.pp
    if cfg.parallel.pp > 1:
        check_micro_batches(settings.micro_batches, settings.batch)  # before any process starts
    cfg.model.activation_checkpointing = False
    if "WORLD_SIZE" in os.environ:  # under torchrun / srun / the DeepSpeed launcher
        from launcher.env import detect

        given = detect().world_size  # RANK, WORLD_SIZE and MASTER_PORT checked before any process group
        if given != world:
            raise ConfigError(
                f"parity runs on exactly --tp x --pp = {world} processes; this launch has WORLD_SIZE={given}"
            )
        return _rank_main(cfg, settings)
    check_model_split(cfg.model, ParallelLayout.from_config(cfg.parallel, world).tp)  # fail before any process starts
    from launcher.local import spawn

    return spawn(_rank_main, world, cfg, settings)
