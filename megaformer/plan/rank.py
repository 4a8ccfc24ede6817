"""One rank's predicted memory and collectives for a step, from the traced pieces: what plan_check compares.

The same sums as :func:`megaformer.plan.search.price`, for the rank of one pipeline stage, with every
collective the step issues: the TP collectives of each micro-batch (traced), DeepSpeed's
(:mod:`megaformer.plan.deepspeed`), the step's control all-reduces over the world (two, of 8 and 32
bytes, without a pipeline; one of 32 with one), and a pipeline's transfers (each micro-batch's
message forward and its gradients back, on the world group; the shared embedding's gradient sent to
its owner and the owner's table sent to each copy).
"""

from __future__ import annotations

from megaformer.config import Config
from megaformer.parallel.layout import padded_vocab_size
from megaformer.parallel.stages import COPY, OWN, plan_stages
from megaformer.pipeline.stage import message
from megaformer.plan.deepspeed import engine_share
from megaformer.plan.price import Piece, stage_piece
from megaformer.plan.record import Collective, summarize
from megaformer.plan.trace import DTYPES
from megaformer.sim.step import MicroShape


def _transfers(cfg: Config, pp: int, stage: int, shape: MicroShape, m: int, tp: int) -> list[Collective]:
    parts = plan_stages(cfg.model, pp, cfg.parallel.pp_split, cfg.data.vocab_size)
    part = parts[stage]
    size = DTYPES[cfg.train.precision].itemsize
    src = shape.sentences * shape.src_len * cfg.model.d_model * size
    tgt = shape.sentences * shape.tgt_len * cfg.model.d_model * size
    sends, recvs = [], []
    if not part.last:
        sends += message(parts[stage + 1], src, src, tgt) * m
        recvs += message(parts[stage + 1], src, src, tgt) * m
    if not part.first:
        recvs += message(part, src, src, tgt) * m
        sends += message(part, src, src, tgt) * m
    table = padded_vocab_size(cfg.data.vocab_size, tp, cfg.parallel.vocab_multiple) // tp * cfg.model.d_model * size
    copies = sum(1 for p in parts if p.embedding == COPY)
    if part.embedding == OWN and copies:
        sends += [table] * copies
        recvs += [table] * copies
    elif part.embedding == COPY:
        sends += [table]
        recvs += [table]
    return [Collective("send", "world", b) for b in sends] + [Collective("recv", "world", b) for b in recvs]


def predict_rank(cfg: Config, parts: tuple[Piece, Piece, Piece], shape: MicroShape, m: int, stage: int) -> dict:
    """Memory (bytes: ``peak``) and collectives (``op group -> count, bytes``) of a rank of ``stage``."""
    p_cfg, t = cfg.parallel, cfg.train
    tp, pp, dp = p_cfg.tp, p_cfg.pp, max(1, p_cfg.dp)
    stages = plan_stages(cfg.model, pp, p_cfg.pp_split, cfg.data.vocab_size)
    part = stages[stage]
    rest, enc, dec = parts
    piece = stage_piece(rest, enc, dec, len(part.encoder), len(part.decoder), part.first, part.last)
    share = engine_share(t.precision, t.zero_stage, int(piece.params), dp, m, t.zero_bucket_size, tp, pp)
    kept = share.grads if m > 1 else 0
    in_flight = min(pp - stage, m)
    if part.embedding == COPY:  # the shared table's copy, a buffer
        size = DTYPES[t.precision].itemsize
        piece = piece.plus(
            Piece(
                weights=padded_vocab_size(cfg.data.vocab_size, tp, p_cfg.vocab_multiple)
                // tp
                * cfg.model.d_model
                * size
            )
        )
    own = max(piece.peak, piece.grads + share.transient)  # the backward's peak, or the reduction after it
    peak = piece.weights + share.state + kept + (in_flight - 1) * piece.activations + own
    calls = list(share.collectives)
    for (op, group, what), n in piece.collectives.items():
        if what == "count" and n > 0:
            total, count = round(piece.collectives[(op, group, "bytes")] * m), round(n * m)
            calls += [Collective(op, group, total // count)] * (count - 1) + [
                Collective(op, group, total - total // count * (count - 1))
            ]
    calls += [Collective("all_reduce", "world", 32)] + ([Collective("all_reduce", "world", 8)] if pp == 1 else [])
    if pp > 1:
        calls += _transfers(cfg, pp, stage, shape, m, tp)
    return {"peak": peak, "collectives": summarize(calls)}
