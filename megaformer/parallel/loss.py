"""Cross-entropy with label smoothing on vocab-parallel logits; the full logits are never gathered.

Rank i holds logits z_i for vocabulary rows [i V/p, (i+1) V/p) of the padded table.
With m = max z, S = sum exp(z - m) over the real vocabulary (V entries) and the
target logit z_t, the smoothed loss of one token is

    (1 - eps) * (log S - (z_t - m)) + eps * (log S - mean over the real vocabulary of (z - m))

which equals ``F.cross_entropy(z, t, label_smoothing=eps)`` on the gathered logits.
Padded vocabulary rows (index >= V) never get probability. Two all-reduces in
forward: the max, then (S, z_t, sum z) stacked into one tensor. The gradient is
softmax(z) - (1 - eps) onehot(t) - eps / V, computed from the saved exp(z - m) and S.

``exp(z - m)`` is taken of ``max(z - m, log(tiny) + 1)``, ``tiny`` the smallest normal
number of the dtype (1.2e-38 in fp32): the CPU's vectorised ``exp`` takes a slow path,
~20 ns an element, for every result that would be subnormal or zero, and a trained
model's logits put most of the vocabulary there (15x slower on a 1,400 x 8,064 slice
with 80 % of it below e^-87: 238 ms against 16 ms, one thread). Such a probability is
then 3.2e-38 instead of less: a change of at most V x 3.2e-38 in S >= 1, below fp32's
resolution, and of the same size in the gradient.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megaformer.parallel import fused
from megaformer.parallel.groups import TPGroup

# Elements of a block of rows in the loss's CPU passes: 1 MiB of fp32 (see _row_blocks)
CPU_BLOCK_ELEMENTS = 1 << 18


class _VocabParallelCrossEntropy(torch.autograd.Function):
    # The (tokens, V / p) logits are by far the largest tensors of the step, so every
    # full pass over them counts. The padded columns (a suffix of the last ranks' slices)
    # are left out through views; the one buffer of the logits' size, in fp32, holds
    # exp(z - m) and then becomes the gradient. The softmax is never divided out in
    # forward: backward scales each row by g / S as it writes the gradient.
    #
    # The passes take two forms (``_cpu_form``). On a GPU each is one kernel over all
    # rows, reading bf16 logits and writing the bf16 gradient in the kernel that
    # computes them (mixed-dtype element-wise ops cast as they load and store). A CPU
    # converts the operand of a mixed-dtype op in a pass of its own, and its ``addcmul``
    # with two per-row operands does not vectorise (4x slower than ``mul_`` + ``add_``):
    # there the passes run over blocks of rows that stay in the core's cache, bf16
    # logits are widened once into the block, and the gradient is scaled in place and
    # then narrowed, so the forward's six passes cost about one trip to memory.

    @staticmethod
    def forward(saved, logits, target, tp: TPGroup, vocab_size: int, smoothing: float, ignore_index: int):
        n, local = logits.shape
        start = tp.rank * local
        real_cols = max(0, min(local, vocab_size - start))  # this rank's real vocabulary rows, a prefix
        compute = torch.promote_types(logits.dtype, torch.float32)  # bf16/fp16 computed in fp32, fp64 kept
        z = logits[:, :real_cols]  # (N, real_cols) view: the padded columns never enter a pass

        if real_cols > 0:
            m = z.amax(dim=-1).to(compute)  # (N,); a max is exact in any dtype
        else:
            m = torch.full((n,), float("-inf"), dtype=compute, device=logits.device)
        if tp.size > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp.group)

        in_range = (target >= start) & (target < start + local)
        local_t = (target - start).masked_fill(~in_range, 0)
        # (sum exp(z - m), z_t, sum z) per token, one tensor for one all-reduce; sum z is of
        # the raw logits, in the compute dtype (m is subtracted below)
        stats = torch.zeros((3, n), dtype=compute, device=logits.device)
        stats[1] = logits.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).to(compute).masked_fill(~in_range, 0.0)
        floor = math.log(torch.finfo(compute).tiny) + 1.0  # exp(floor) is a normal number: the fast path
        cpu_form = _cpu_form(logits.device)
        if not cpu_form and compute == torch.float32 and fused.enabled():
            exp = None  # one pass, reading the logits in their own dtype
            if real_cols > 0:
                sums = fused.ce_sums(z, m, floor)
                stats[0], stats[2] = sums[0], sums[1]
        else:
            exp = torch.empty((n, local), dtype=compute, device=logits.device)
        for rows in _row_blocks(n, real_cols, cpu_form) if exp is not None else ():
            e, zr = exp[rows, :real_cols], z[rows]
            if cpu_form and zr.dtype != compute:  # widened once, into the block of the buffer
                zr = e.copy_(zr)
            if smoothing > 0:
                torch.sum(zr, -1, dtype=compute, out=stats[2, rows])
            torch.sub(zr, m[rows].unsqueeze(-1), out=e).clamp_min_(floor).exp_()
            torch.sum(e, -1, out=stats[0, rows])
        if tp.size > 1:
            dist.all_reduce(stats, group=tp.group)
        sum_exp, z_t, sum_z = stats
        log_s = sum_exp.log()
        loss = (1.0 - smoothing) * (log_s - (z_t - m))
        if smoothing > 0:
            loss = loss + smoothing * (log_s - (sum_z / vocab_size - m))
        keep = target != ignore_index
        loss = loss.masked_fill(~keep, 0.0)

        # the fused form keeps the logits (alive anyway as the matmul's output) instead of an fp32 exp buffer
        saved.save_for_backward(logits if exp is None else exp, sum_exp, local_t, in_range, keep, m)
        saved.smoothing, saved.vocab_size, saved.real_cols, saved.dtype = smoothing, vocab_size, real_cols, logits.dtype
        saved.fused, saved.floor = exp is None, floor
        return loss

    @staticmethod
    def backward(saved, grad_loss):
        exp, sum_exp, local_t, in_range, keep, m = saved.saved_tensors
        eps, real_cols = saved.smoothing, saved.real_cols
        g = grad_loss * keep  # (N,)
        if saved.fused:  # ``exp`` holds the logits: their gradient in one pass
            scale, shift = g / sum_exp, g * (-eps / saved.vocab_size)
            at_target = g * in_range * (1.0 - eps)
            grad = fused.ce_grad(exp, m, saved.floor, scale, shift, local_t, at_target, real_cols)
            return grad, None, None, None, None, None
        # The gradient is (softmax - (1 - eps) onehot(t)) g - eps g / V over the real columns,
        # written as (exp - (1 - eps) S onehot(t)) (g / S) - eps g / V: the target column
        # first, in the compute dtype (sum_exp first: a python float times a bool tensor
        # would be fp32, rounding (1 - eps) for fp64 logits), then the scaling pass.
        exp.scatter_add_(-1, local_t.unsqueeze(-1), (sum_exp * in_range * -(1.0 - eps)).unsqueeze(-1))
        scale = (g / sum_exp).unsqueeze(-1)
        shift = (g * (-eps / saved.vocab_size)).unsqueeze(-1)
        # fp32/fp64 logits take the buffer itself as their gradient (backward runs once)
        grad = exp if exp.dtype == saved.dtype else torch.empty(exp.shape, dtype=saved.dtype, device=exp.device)
        cpu_form = _cpu_form(exp.device)
        for rows in _row_blocks(exp.shape[0], real_cols, cpu_form):
            block = exp[rows, :real_cols]
            if not cpu_form:  # one kernel: read fp32, write the logits' dtype
                torch.addcmul(shift[rows], block, scale[rows], out=grad[rows, :real_cols])
                continue
            block.mul_(scale[rows])
            if eps > 0:
                block.add_(shift[rows])
            if grad is not exp:
                grad[rows, :real_cols] = block
        grad[:, real_cols:] = 0.0  # padded rows never get probability
        return grad, None, None, None, None, None


def _cpu_form(device: torch.device) -> bool:
    """Whether the loss's passes take their CPU form (blocks in cache, widening and scaling in passes of their own)."""
    return device.type == "cpu"


def _row_blocks(rows: int, cols: int, cpu_form: bool) -> Iterator[slice]:
    """Blocks of rows for the loss's passes: of ~1 MiB of fp32 in the CPU form (a core's L2 holds it), else all rows.

    A GPU streams each pass at memory speed whatever its size, and a kernel launch a block
    would only add to its host time.
    """
    if not cpu_form:
        yield slice(0, rows)
        return
    step = max(1, CPU_BLOCK_ELEMENTS // max(cols, 1))
    for first in range(0, rows, step):
        yield slice(first, min(rows, first + step))


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp: TPGroup,
    vocab_size: int,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Per-token loss (0 where ``target == ignore_index``) from this rank's slice of the logits.

    ``logits``: (N, V_padded / tp), any float dtype (bf16 and fp16 computed in fp32,
    fp64 in fp64); ``target``: (N,) ids of the real vocabulary; ``vocab_size``: V, the
    real (unpadded) size.
    """
    return _VocabParallelCrossEntropy.apply(logits, target, tp, vocab_size, label_smoothing, ignore_index)
