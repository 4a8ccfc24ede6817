"""BLEU during training: greedy decoding of the first validation sentences, scored by sacreBLEU.

Every ``train.eval_interval`` steps the trainer decodes the first
``train.eval_bleu_sentences`` sources of the valid split with greedy search
(:func:`megaformer.decode.translate.translate_ids`, beam 1, the length limits of
``decode.*``) and scores the detokenized output against the raw references that
``megaformer prepare`` keeps beside the shards (``raw.src`` / ``raw.ref`` of the split in
the manifest), as ``megaformer evaluate`` does: cased and lowercased sacreBLEU (13a).
A prepared directory without raw text falls back to the valid shards' ids, the
references then being the target ids decoded by the tokenizer.

Sources are encoded as ``translate`` encodes them (sentencepiece ids + eos), cut to
``model.max_positions`` tokens (eos kept) instead of refused; a blank source line gives
an empty hypothesis.

**Parallelism.** Each DP replica decodes a share of the sentences (every ``dp``-th,
starting at its DP rank); the TP ranks of a replica decode together in lock step (the
logits stay vocab-parallel). The hypotheses are gathered over the DP group, so every
rank scores the same text and gets the same BLEU (the trainer's decision to keep a
"best" checkpoint needs every rank to agree). A pipeline (``parallel.pp > 1``) and
sequence parallelism are skipped: greedy decoding through stages, or with sequences
split over TP ranks, is not supported.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from megaformer.data.manifest import manifest_path, read_manifest
from megaformer.data.shards import open_prepared, read_shard
from megaformer.data.tokenizer import EOS_ID, Tokenizer
from megaformer.decode.beam import SearchSettings
from megaformer.decode.evaluate import corpus_scores, tokenized_bleu
from megaformer.decode.translate import translate_ids
from megaformer.model import Transformer
from megaformer.parallel import ParallelContext


@dataclass(frozen=True)
class BleuSample:
    """The first sentences of the valid split: source ids (eos included; [] for a blank line), raw references,
    and the tokenizer that detokenizes the hypotheses."""

    sources: list[list[int]]
    references: list[str]
    tokenizer: Tokenizer


def bleu_skip_reason(count: int, has_valid: bool, pp: int, sequence_parallel: bool) -> str | None:
    """Why BLEU is not computed during training, or None when it is."""
    if count == 0:
        return "train.eval_bleu_sentences=0"
    if not has_valid:
        return "the prepared data has no valid split"
    if pp > 1:
        return f"parallel.pp={pp}: greedy decoding through pipeline stages is not supported"
    if sequence_parallel:
        return "parallel.sequence_parallel: decoding needs a model without sequence parallelism"
    return None


def _encode(tokenizer: Tokenizer, line: str, max_positions: int) -> list[int]:
    """Ids + eos of a source line, at most ``max_positions`` of them; [] for a blank line."""
    if not line.strip():
        return []
    return tokenizer.encode([line])[0][: max_positions - 1] + [EOS_ID]


def _first_lines(path: Path, count: int) -> list[str]:
    with open(path, encoding="utf-8", newline="") as f:
        return [line.rstrip("\n").rstrip("\r") for line in itertools.islice(f, count)]


def load_bleu_sample(data_path: str | Path, count: int, max_positions: int) -> BleuSample:
    """The first ``count`` valid pairs of a prepared directory: raw text if kept, else the shards' ids."""
    mpath = manifest_path(data_path)
    split = read_manifest(mpath)["splits"]["valid"]
    prepared = open_prepared(mpath, "valid")
    tokenizer = Tokenizer(prepared.tokenizer_path)
    raw = split.get("raw")
    if raw and (mpath.parent / raw["src"]).is_file() and (mpath.parent / raw["ref"]).is_file():
        lines = _first_lines(mpath.parent / raw["src"], count)
        references = _first_lines(mpath.parent / raw["ref"], len(lines))
        return BleuSample([_encode(tokenizer, line, max_positions) for line in lines], references, tokenizer)
    sources, references = [], []
    for url, size in zip(prepared.urls, prepared.shard_sizes):
        for _, src, tgt in read_shard(url, expected=size):
            ids = [int(i) for i in src]
            sources.append(ids[: max_positions - 1] + [EOS_ID] if ids else [])
            references.append(tokenizer.decode([int(i) for i in tgt]))
            if len(sources) == count:
                return BleuSample(sources, references, tokenizer)
    return BleuSample(sources, references, tokenizer)


def sample_bleu(
    model: Transformer,
    sample: BleuSample,
    settings: SearchSettings,
    max_tokens: int,
    ctx: ParallelContext,
    tokenized_lang: str | None = None,
) -> dict[str, float]:
    """``{"bleu", "bleu_lc"}`` of greedy translations of ``sample``, and ``"bleu_tok"`` (the paper's tokenized
    compound-split BLEU) with ``tokenized_lang``; every rank of the run calls this.

    DP rank ``r`` decodes sentences ``r, r + dp, ...``; the shares are gathered over the
    DP group, so every rank returns the same scores. ``model`` must be in eval mode.
    """
    share = list(range(ctx.dp_rank, len(sample.sources), ctx.dp_size))
    hyps = translate_ids(model, [sample.sources[i] for i in share], settings, max_tokens)
    texts = ["" if h is None else sample.tokenizer.decode(h.tokens) for h in hyps]
    shares = [texts]
    if ctx.dp_size > 1 and dist.is_initialized():
        shares = [None] * ctx.dp_size
        dist.all_gather_object(shares, texts, group=ctx.dp_group)
    hypotheses = [""] * len(sample.sources)
    for rank, part in enumerate(shares):
        for i, text in zip(range(rank, len(sample.sources), ctx.dp_size), part):
            hypotheses[i] = text
    scores = corpus_scores(hypotheses, sample.references)
    result = {"bleu": scores.bleu, "bleu_lc": scores.bleu_lc}
    if tokenized_lang:
        result["bleu_tok"] = tokenized_bleu(hypotheses, sample.references, tokenized_lang).bleu
    return result
