"""DeepSpeed's share of a rank's memory and collectives, modelled: it cannot run on a fake group or fake tensors.

DeepSpeed's optimizers build flat buffers on a real accelerator and read values (overflow, norms) on
the host, so the plan models them from their documented behaviour, as measured on this CPU over gloo
(``benchmarks/plan_check.py`` checks every figure against a real run). ``P`` is the rank's parameter
elements, ``dp`` the data-parallel size, ``m`` the micro-batches per step, ``B`` ``train.zero_bucket_size``
(elements); gradients are reduced in fp32 (bf16 too: ``communication_data_type``):

=============  =================================================  =========================================
path           state beside the weights (bytes)                   collectives per step (over dp)
=============  =================================================  =========================================
fp32 ZeRO-0    Adam's moments 8P                                  all-reduce 4P in ceil(P/B) buckets
fp32 ZeRO-1    fp32 partition 4P/dp, moments 8P/dp, bucket 4B'    the same, a flag, all-gather 4P/dp
fp32 ZeRO-2    as ZeRO-1; grads kept 4P/dp, not 4P; copy 4B'      the all-reduce at every micro-batch
bf16 ZeRO-1    fp32 partition and moments 12P/dp, fp32 grads 4P   all-reduce 4P, all-gather 2P/dp
bf16 ZeRO-2    12P/dp, bucket 2B'; grads 2P/dp; fp32 copy 4B'     the all-reduce at every micro-batch
=============  =================================================  =========================================

``B' = min(B, P)``: a bucket is no larger than what it holds. ZeRO-2 reduces a bucket through a flat
copy of it in the communication dtype (fp32: ``allreduce_bucket`` flattens it anew, DeepSpeed 0.19's
``stage_1_and_2.py``), after the micro-batch's backward: a ``transient`` beside the micro-batch's gradients,
not its activations (transformer_base fp32 at dp=2 peaked there, with the bucket and its copy both 4P). Where DeepSpeed computes no gradient norm
(fp32 ZeRO-0), the engine computes it: one 8-byte all-reduce over TP and one over the stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megaformer.plan.record import Collective


@dataclass(frozen=True)
class EngineShare:
    state: int  # bytes held through the step beside the weights (fp32 copies, moments, buckets)
    grads: int  # gradient bytes kept between micro-batches
    collectives: list[Collective]
    transient: int = 0  # bytes alive while a bucket is reduced, after a micro-batch's backward


def _buckets(elements: int, bucket: int) -> int:
    return max(1, math.ceil(elements / bucket))


def _split(op: str, group: str, total: int, calls: int) -> list[Collective]:
    """``calls`` collectives carrying ``total`` bytes together (bucket by bucket, the last the remainder)."""
    each = -(-total // calls)
    return [Collective(op, group, min(each, total - i * each)) for i in range(calls)]


def engine_share(precision: str, zero: int, params: int, dp: int, m: int, bucket: int, tp: int, pp: int) -> EngineShare:
    """DeepSpeed's memory and collectives for one rank's step (see the module docstring)."""
    p, low = params, precision != "fp32"
    reduce = _split("all_reduce", "dp", 4 * p, _buckets(p, bucket))
    part = -(-p // dp)
    gather = _split("all_gather", "dp", (2 if low else 4) * part, _buckets(part, bucket))
    if zero == 0:
        norm = [Collective("all_reduce", g, 8) for g, n in (("tp", tp), ("pp", pp)) if n > 1]
        return EngineShare(8 * p, 4 * p, reduce + norm)
    if not low and zero == 1:
        return EngineShare(12 * part + 4 * min(bucket, p), 4 * p, reduce + [Collective("all_reduce", "dp", 4)] + gather)
    if not low:
        return EngineShare(
            12 * part + 4 * min(bucket, p),
            4 * part,
            reduce * m + [Collective("all_reduce", "dp", 4)] + gather,
            4 * min(bucket, p),
        )
    if zero == 1:
        return EngineShare(12 * part + 4 * p, 0, reduce + [Collective("all_reduce", "world", 4)] + gather)
    flags = [Collective("all_reduce", "dp", 4), Collective("all_reduce", "dp", 1)]
    return EngineShare(12 * part + 2 * min(bucket, p), 2 * part, reduce * m + flags + gather, 4 * min(bucket, p))
