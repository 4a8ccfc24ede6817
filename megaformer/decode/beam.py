"""Batched beam search and greedy search on a (tensor-parallel) Transformer.

The paper's settings (section 6.1): beam 4, length penalty alpha = 0.6, maximum output
length = source length + 50, stopping early when possible.

**Scores.** A hypothesis Y (its tokens and the eos that ends it) scores

    score(Y) = log P(Y | X) / lp(Y),   lp(Y) = ((5 + |Y|) / 6) ** alpha      (GNMT)

where |Y| counts the eos, as tensor2tensor (the paper's code) does. log P is normalised
over the real vocabulary; pad, bos and the padding rows of the table are never chosen.

**Lengths.** A sentence with ``n`` source tokens (its non-pad ids, the eos that ends
every source included) gets at most ``floor(a n + b)`` output tokens before its eos,
capped at ``max_positions - 1`` (bos + output must fit the positions): at that step
eos is the only choice. ``min_len`` bans eos until a hypothesis has that many tokens (used
by the benchmark to force a length); the maximum wins where they conflict.

**Search.** Each step, every live hypothesis proposes its 2·beam best tokens
(:func:`megaformer.decode.vocab_topk.vocab_parallel_topk`: the logits stay
vocab-parallel); per sentence the 2·beam best (hypothesis, token) pairs by cumulative
log-probability are kept. Those ending in eos *among the first beam of them* become
finished hypotheses; the first beam that do not end in eos are the next live
hypotheses (there are always enough: a hypothesis proposes eos at most once). This is
fairseq's scheme; ties go to the earlier hypothesis, then the better-ranked token.

**Stopping.** A sentence is done when (fairseq's rule) ``beam`` hypotheses have
finished, or at its maximum length, or, earlier, when no live hypothesis can still
beat the best finished one: log P only falls as tokens are added, so a live
hypothesis's best possible final score is its log P now divided by the largest lp
still reachable. The last rule never changes the result, it only saves steps. Done
sentences leave the batch (their rows are dropped from the cache and the memory).
The output is the best finished hypothesis (ties: the one finished first).

**Cache.** With ``use_cache`` the decoder keeps keys and values
(:class:`megaformer.model.DecoderCache`), feeds one new token a step and reorders the
cache along the surviving hypotheses; without it the whole prefix is recomputed every
step (for tests and the benchmark). Both give the same hypotheses.

**Tensor parallelism.** Every rank runs the same search on the same inputs; the
per-step candidates come from one all-gather and are bit-identical on every rank, so
the ranks take the same decisions and stay in step. Ties resolve to the lower token id,
so TP=N decodes what TP=1 decodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megaformer.config import DecodeConfig
from megaformer.data.tokenizer import BOS_ID, EOS_ID
from megaformer.decode.vocab_topk import Candidates, vocab_parallel_topk
from megaformer.model import DecoderCache, Transformer


@dataclass(frozen=True)
class Hypothesis:
    """One output sentence."""

    tokens: list[int]  # output ids, without bos and eos
    score: float  # logprob / lp(len(tokens) + 1)
    logprob: float  # log P(tokens + eos | source)


@dataclass(frozen=True)
class SearchSettings:
    """How to search; :meth:`from_config` takes the paper's defaults from ``DecodeConfig``."""

    beam: int = 4
    lenpen: float = 0.6  # alpha of the GNMT length penalty
    max_len_a: float = 1.0  # at most floor(a * source length + b) output tokens
    max_len_b: int = 50
    min_len: int = 0  # eos is banned before this many output tokens
    use_cache: bool = True  # False: recompute the whole prefix every step

    @classmethod
    def from_config(cls, cfg: DecodeConfig, **overrides) -> SearchSettings:
        """Settings from the decode config, with keyword overrides (None values are ignored)."""
        values = dict(beam=cfg.beam, lenpen=cfg.lenpen, max_len_a=cfg.max_len_a, max_len_b=cfg.max_len_b)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def __post_init__(self) -> None:
        if self.beam < 1:
            raise ValueError(f"beam must be at least 1, got {self.beam}")
        if not (math.isfinite(self.lenpen) and math.isfinite(self.max_len_a)):
            raise ValueError(f"lenpen and max_len_a must be finite numbers, got {self.lenpen}, {self.max_len_a}")
        if self.max_len_a < 0 or self.max_len_b < 0 or self.min_len < 0:
            raise ValueError(
                f"max_len_a, max_len_b and min_len must be >= 0, got {self.max_len_a}, {self.max_len_b}, {self.min_len}"
            )


def length_penalty(length: int | torch.Tensor, alpha: float) -> float | torch.Tensor:
    """GNMT's lp(Y) = ((5 + |Y|) / 6) ** alpha, |Y| counting the eos."""
    return ((5.0 + length) / 6.0) ** alpha


def max_output_lengths(src: torch.Tensor, pad_id: int, max_positions: int, a: float, b: int) -> torch.Tensor:
    """(batch,) int64 on the CPU: floor(a * n + b) for n non-pad source tokens, at most max_positions - 1.

    The decoder input at the last step holds bos and every output token (the eos is
    predicted, never fed): ``max_positions - 1`` output tokens fit, as in training.
    """
    n = src.ne(pad_id).sum(-1).double()  # (batch,)
    wanted = torch.floor(a * n + b + 1e-9).long()  # 1e-9: 0.3 * 10 must give 3, not 2
    return wanted.clamp(max=max(max_positions - 1, 0)).cpu()


def _check(model: Transformer, src: torch.Tensor, beam: int) -> None:
    if model.training:
        raise ValueError("decoding needs model.eval(): dropout would make the search random")
    if model.sequence_parallel:
        raise ValueError("decode with a model built without sequence parallelism")
    selectable = model.vocab_size - 2  # pad and bos are never produced
    if 2 * beam > selectable:
        raise ValueError(f"beam {beam} needs {2 * beam} candidate tokens, the vocabulary has {selectable}")
    if src.dim() != 2 or src.shape[0] == 0:
        raise ValueError(f"src must be a non-empty (batch, src_len) tensor of ids, got shape {tuple(src.shape)}")
    if not bool(src.ne(model.pad_id).any(-1).all()):
        raise ValueError("every source row needs at least one token (an all-padding row has nothing to attend to)")


def _step_logits(
    model: Transformer,
    tokens: torch.Tensor,
    memory: torch.Tensor,
    memory_mask: torch.Tensor | None,
    cache: DecoderCache | None,
) -> torch.Tensor:
    """This rank's logits slice (rows, padded_vocab / tp) for the token after ``tokens`` (rows, t)."""
    if cache is not None:
        hidden = model.decode(tokens[:, -1:], memory, memory_mask, cache)  # (rows, 1, d)
    else:
        hidden = model.decode(tokens, memory, memory_mask)[:, -1:]  # (rows, 1, d)
    return model.logits(hidden)[:, -1]


def _end_masks(limit: torch.Tensor, step: int, min_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ban_eos, only_eos) per row for output position ``step`` given each row's maximum length."""
    only_eos = (limit <= step).to(device)
    ban_eos = torch.full_like(only_eos, step < min_len) & ~only_eos
    return ban_eos, only_eos


@torch.no_grad()
def beam_search(model: Transformer, src: torch.Tensor, settings: SearchSettings) -> list[Hypothesis]:
    """The best hypothesis of each source row; ``src`` (batch, src_len) right-padded ids.

    Every rank of ``model.tp`` must call this with the same ``src`` and settings.
    """
    _check(model, src, settings.beam)
    beam, k = settings.beam, 2 * settings.beam
    n, device = src.shape[0], src.device
    limits = max_output_lengths(src, model.pad_id, model.cfg.max_positions, settings.max_len_a, settings.max_len_b)

    # (n, src_len, d): a row per sentence, which its beam rows (row = sentence * beam + b) share
    memory, memory_mask = model.encode(src)
    cache = DecoderCache(len(model.decoder)) if settings.use_cache else None
    active, tokens, scores = _start(n, beam, device)
    finished: list[list[Hypothesis]] = [[] for _ in range(n)]
    best_done = torch.full((n,), float("-inf"), dtype=torch.float64)  # best finished score per sentence

    for step in range(int(limits.max()) + 1):
        m = active.numel()
        limit = limits[active]  # (m,)
        ban_eos, only_eos = _end_masks(limit.repeat_interleave(beam), step, settings.min_len, device)
        logits = _step_logits(model, tokens, memory, memory_mask, cache)
        cand = _candidates(model, logits, k, ban_eos, only_eos)
        kc = cand.token.shape[1]
        total = (scores.unsqueeze(-1) + cand.logprob).view(m, beam * kc)  # (m, beam kc)
        order = total.argsort(dim=-1, descending=True, stable=True)[:, :k]  # (m, 2 beam)
        top = total.gather(-1, order)
        token = cand.token.view(m, beam * kc).gather(-1, order)
        row = order // kc + torch.arange(m, device=device).unsqueeze(-1) * beam  # (m, 2 beam) source rows
        is_eos = token.eq(EOS_ID)

        _finish_eos(
            finished, best_done, active, tokens, top, row, is_eos, beam, length_penalty(step + 1, settings.lenpen)
        )

        # The next live hypotheses: the first `beam` candidates that do not end in eos.
        live = is_eos.int().argsort(dim=-1, stable=True)[:, :beam]  # (m, beam)
        next_row, next_token, next_score = row.gather(-1, live), token.gather(-1, live), top.gather(-1, live)

        done = _done(finished, best_done, active, limit, next_score, beam, step, settings.lenpen)  # (m,)
        if bool(done.all()):
            break
        keep = (~done).nonzero().squeeze(-1)  # (m',) positions among the active sentences
        index = next_row.index_select(0, keep.to(device)).view(-1)  # (m' beam,) rows to continue
        tokens = torch.cat([tokens.index_select(0, index), next_token.index_select(0, keep.to(device)).view(-1, 1)], 1)
        scores = next_score.index_select(0, keep.to(device)).view(-1)
        shrink = bool(done.any())
        if cache is not None:
            cache.reorder(index, keep.to(device) if shrink else None)
        if shrink:
            memory, memory_mask, active = _keep_sentences(keep, memory, memory_mask, active)

    return [max(f, key=lambda h: h.score) for f in finished]  # max keeps the first of equal scores


def _candidates(
    model: Transformer, logits: torch.Tensor, k: int, ban_eos: torch.Tensor, only_eos: torch.Tensor
) -> Candidates:
    """The ``k`` best next tokens of every row (never pad or bos; eos banned or forced per row); ``logits`` is
    overwritten."""
    never = (model.pad_id, BOS_ID)
    return vocab_parallel_topk(
        logits, k, model.tp, model.vocab_size, never=never, eos_id=EOS_ID, ban_eos=ban_eos, only_eos=only_eos,
        consume=True,
    )  # fmt: skip


def _start(n: int, beam: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(active sentences, tokens (n beam, 1) = bos, cumulative scores (n beam,)); only the first beam is live."""
    active = torch.arange(n)  # original index of each sentence still searched
    tokens = torch.full((n * beam, 1), BOS_ID, dtype=torch.long, device=device)  # (rows, t)
    scores = torch.zeros(n, beam, dtype=torch.float64, device=device)
    scores[:, 1:] = float("-inf")  # all beams start equal: expand only the first
    return active, tokens, scores.view(-1)


def _keep_sentences(
    keep: torch.Tensor, memory: torch.Tensor, memory_mask: torch.Tensor | None, active: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The encoder rows, masks and indices of the sentences at positions ``keep``."""
    rows = keep.to(memory.device)
    memory = memory.index_select(0, rows)
    if memory_mask is not None:
        memory_mask = memory_mask.index_select(0, rows)
    return memory, memory_mask, active[keep]


def _finish_eos(
    finished: list[list[Hypothesis]],
    best_done: torch.Tensor,
    active: torch.Tensor,
    tokens: torch.Tensor,
    top: torch.Tensor,
    row: torch.Tensor,
    is_eos: torch.Tensor,
    beam: int,
    lp: float,
) -> None:
    """Record the eos candidates among the first ``beam`` of each sentence as finished hypotheses (score / lp)."""
    ends = (is_eos[:, :beam] & torch.isfinite(top[:, :beam])).nonzero().tolist()
    if not ends:
        return
    top_cpu, row_cpu = top.cpu(), row.cpu()
    for i, j in ends:
        sentence = int(active[i])
        if len(finished[sentence]) < beam:
            logprob = float(top_cpu[i, j])
            hyp = Hypothesis(tokens[row_cpu[i, j], 1:].tolist(), logprob / lp, logprob)
            finished[sentence].append(hyp)
            best_done[sentence] = max(float(best_done[sentence]), hyp.score)


def _done(
    finished: list[list[Hypothesis]],
    best_done: torch.Tensor,
    active: torch.Tensor,
    limit: torch.Tensor,
    next_score: torch.Tensor,
    beam: int,
    step: int,
    lenpen: float,
) -> torch.Tensor:
    """(m,) True for the sentences whose search is over: beam hypotheses finished, length limit, or no live
    hypothesis can still beat the best finished one (its best possible length penalty is already counted)."""
    m = active.numel()
    counts = torch.tensor([len(finished[int(s)]) for s in active])
    future_lp = torch.maximum(
        length_penalty(limit.double() + 1, lenpen),
        torch.full((m,), length_penalty(step + 2, lenpen), dtype=torch.float64),
    )
    best_live = next_score[:, 0].cpu()  # candidates are sorted: the first live one is the best
    hopeless = (counts > 0) & (best_live / future_lp <= best_done[active])
    return (counts >= beam) | (limit <= step) | hopeless


@torch.no_grad()
def greedy_search(model: Transformer, src: torch.Tensor, settings: SearchSettings) -> list[Hypothesis]:
    """The argmax continuation of each source row (``settings.beam`` is ignored); same scores as beam search."""
    _check(model, src, 1)
    n, device = src.shape[0], src.device
    limits = max_output_lengths(src, model.pad_id, model.cfg.max_positions, settings.max_len_a, settings.max_len_b)
    memory, memory_mask = model.encode(src)
    cache = DecoderCache(len(model.decoder)) if settings.use_cache else None

    active = torch.arange(n)
    tokens = torch.full((n, 1), BOS_ID, dtype=torch.long, device=device)
    scores = torch.zeros(n, dtype=torch.float64, device=device)
    out: list[Hypothesis | None] = [None] * n
    for step in range(int(limits.max()) + 1):
        ban_eos, only_eos = _end_masks(limits[active], step, settings.min_len, device)
        logits = _step_logits(model, tokens, memory, memory_mask, cache)
        cand = vocab_parallel_topk(
            logits,
            1,
            model.tp,
            model.vocab_size,
            never=(model.pad_id, BOS_ID),
            eos_id=EOS_ID,
            ban_eos=ban_eos,
            only_eos=only_eos,
            consume=True,
        )
        token = cand.token[:, 0]
        scores = scores + cand.logprob[:, 0]
        ended = token.eq(EOS_ID).cpu()
        lp = length_penalty(step + 1, settings.lenpen)
        for i in ended.nonzero().squeeze(-1).tolist():
            logprob = float(scores[i])
            out[int(active[i])] = Hypothesis(tokens[i, 1:].tolist(), logprob / lp, logprob)
        if bool(ended.all()):
            break
        keep = (~ended).nonzero().squeeze(-1).to(device)
        tokens = torch.cat([tokens, token.unsqueeze(-1)], dim=1)
        if bool(ended.any()):
            tokens, scores = tokens.index_select(0, keep), scores.index_select(0, keep)
            memory = memory.index_select(0, keep)
            if memory_mask is not None:
                memory_mask = memory_mask.index_select(0, keep)
            if cache is not None:
                cache.reorder(keep, keep)
            active = active[keep.cpu()]
    assert all(h is not None for h in out), "every sentence ends by its maximum length"
    return out  # type: ignore[return-value]


def search(model: Transformer, src: torch.Tensor, settings: SearchSettings) -> list[Hypothesis]:
    """Greedy search for beam 1 (the same result, less work), beam search otherwise."""
    return greedy_search(model, src, settings) if settings.beam == 1 else beam_search(model, src, settings)
