"""Cross-entropy with label smoothing on vocab-parallel logits; the full logits are never gathered.

Rank i holds logits z_i for vocabulary rows [i V/p, (i+1) V/p) of the padded table.
With m = max z, S = sum exp(z - m) over the real vocabulary (V entries) and the
target logit z_t, the smoothed loss of one token is

    (1 - eps) * (log S - (z_t - m)) + eps * (log S - mean over the real vocabulary of (z - m))

which equals ``F.cross_entropy(z, t, label_smoothing=eps)`` on the gathered logits.
Padded vocabulary rows (index >= V) never get probability. Two all-reduces in
forward: the max, then (S, z_t, sum z) stacked into one tensor. The gradient is
softmax(z) - (1 - eps) onehot(t) - eps / V, computed from the saved softmax.

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

import torch
import torch.distributed as dist

from megaformer.parallel.groups import TPGroup


class _VocabParallelCrossEntropy(torch.autograd.Function):
    # The (tokens, V / p) logits are by far the largest tensors of the step, so every
    # full pass over them counts: the padded columns (a suffix of the last ranks'
    # slices) are left out through views instead of masked copies, bf16/fp16 logits are
    # read as they are (no fp32 copy of them), and exp(z - m) is written once, in fp32,
    # into the buffer that becomes the softmax and then the gradient.

    @staticmethod
    def forward(saved, logits, target, tp: TPGroup, vocab_size: int, smoothing: float, ignore_index: int):
        local = logits.shape[-1]
        start = tp.rank * local
        real_cols = max(0, min(local, vocab_size - start))  # this rank's real vocabulary rows, a prefix
        saved.dtype = logits.dtype
        compute = torch.promote_types(logits.dtype, torch.float32)  # bf16/fp16 computed in fp32, fp64 kept
        z = logits[:, :real_cols]  # (N, real_cols) view, in the logits' own dtype: no fp32 copy of them

        if real_cols > 0:
            m = z.amax(dim=-1).to(compute)  # (N,); a max is exact in any dtype
        else:
            m = torch.full(logits.shape[:1], float("-inf"), dtype=compute, device=logits.device)
        if tp.size > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp.group)

        in_range = (target >= start) & (target < start + local)
        local_t = (target - start).masked_fill(~in_range, 0)
        z_t = logits.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).to(compute).masked_fill(~in_range, 0.0)
        # Of the raw logits, accumulated in the compute dtype; m is subtracted below.
        sum_z = z.sum(-1, dtype=compute) if smoothing > 0 else torch.zeros_like(m)
        floor = math.log(torch.finfo(compute).tiny) + 1.0  # exp(floor) is a normal number: the fast path
        # (N, V/p) in the compute dtype, the only full-size copy: the softmax, then the gradient.
        exp = torch.sub(logits, m.unsqueeze(-1)).clamp_min_(floor).exp_()
        exp[:, real_cols:] = 0.0  # padded rows never get probability
        stats = torch.stack([exp.sum(-1), z_t, sum_z])  # (3, N)
        if tp.size > 1:
            dist.all_reduce(stats, group=tp.group)
        sum_exp, z_t, sum_z = stats
        log_s = sum_exp.log()
        loss = (1.0 - smoothing) * (log_s - (z_t - m))
        if smoothing > 0:
            loss = loss + smoothing * (log_s - (sum_z / vocab_size - m))
        keep = target != ignore_index
        loss = loss.masked_fill(~keep, 0.0)

        exp.div_(sum_exp.unsqueeze(-1))  # softmax, this rank's slice
        saved.save_for_backward(exp, local_t, in_range, keep)
        saved.smoothing, saved.vocab_size, saved.real_cols = smoothing, vocab_size, real_cols
        return loss

    @staticmethod
    def backward(saved, grad_loss):
        softmax, local_t, in_range, keep = saved.saved_tensors
        eps = saved.smoothing
        g = (grad_loss * keep).unsqueeze(-1)  # (N, 1)
        grad = softmax  # reused in place: backward runs once; padded columns stay 0
        real = grad[:, : saved.real_cols]
        if eps > 0:
            # (softmax - eps / V) * g over the real columns in one pass
            torch.addcmul(g * (-eps / saved.vocab_size), real, g, out=real)
        else:
            real.mul_(g)
        # g first: a python float times a bool tensor would be fp32, rounding (1 - eps) for fp64 logits
        grad.scatter_add_(-1, local_t.unsqueeze(-1), g * in_range.unsqueeze(-1) * -(1.0 - eps))
        return grad.to(saved.dtype), None, None, None, None, None


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
