"""Scoring translations (sacreBLEU's BLEU and chrF, with their signatures) and checkpoint averaging.

BLEU is computed by sacreBLEU on detokenized text against raw references, so the number
comes with a signature (tokenizer, smoothing, version) that says how it was made; the
paper's 27.3 / 28.4 EN-DE figures are tokenized BLEU and are not directly comparable.

Averaging follows the paper (section 6.1): the element-wise mean of the parameters of
the last checkpoints of a run. Models with different configs, vocabularies, tokenizers
or parameter shapes are refused, naming both files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from sacrebleu.metrics import BLEU, CHRF

from megaformer.config import to_dict
from megaformer.decode.loading import load_model_file
from megaformer.errors import CheckpointError, DataError
from megaformer.train.checkpoint import Consolidated, check_complete, checkpoint_root, list_checkpoints


@dataclass(frozen=True)
class Scores:
    """Corpus-level scores of one set of hypotheses."""

    bleu: float  # cased (sacreBLEU's default)
    chrf: float
    bleu_signature: str  # e.g. nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0
    chrf_signature: str
    bleu_text: str  # sacreBLEU's line: "BLEU|<signature> = 27.31 58.1/33.2/20.9/13.6 (BP = ...)"
    chrf_text: str
    bleu_lc: float  # lowercased (sacreBLEU -lc), what Multi30k papers report
    bleu_lc_signature: str  # ...|case:lc|...
    bleu_lc_text: str


def corpus_scores(hypotheses: Sequence[str], references: Sequence[str], tokenize: str = "13a") -> Scores:
    """sacreBLEU corpus BLEU (cased and lowercased) and chrF of detokenized ``hypotheses``, one reference each."""
    if len(hypotheses) != len(references):
        raise DataError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    if not hypotheses:
        raise DataError("no sentences to score")
    bleu, bleu_lc, chrf = BLEU(tokenize=tokenize), BLEU(tokenize=tokenize, lowercase=True), CHRF()
    hyps, refs = list(hypotheses), [list(references)]
    b, lc, c = bleu.corpus_score(hyps, refs), bleu_lc.corpus_score(hyps, refs), chrf.corpus_score(hyps, refs)
    b_sig, lc_sig, c_sig = str(bleu.get_signature()), str(bleu_lc.get_signature()), str(chrf.get_signature())
    return Scores(
        b.score,
        c.score,
        b_sig,
        c_sig,
        b.format(signature=b_sig),
        c.format(signature=c_sig),
        lc.score,
        lc_sig,
        lc.format(signature=lc_sig),
    )


# ---- checkpoint averaging -------------------------------------------------------------------


def _differences(a: Consolidated, b: Consolidated) -> list[str]:
    """What keeps ``a`` and ``b`` from being averaged, as short phrases."""
    found = []
    ma, mb = to_dict(a.config)["model"], to_dict(b.config)["model"]
    found += [f"model.{k} {ma[k]!r} vs {mb[k]!r}" for k in ma if k != "activation_checkpointing" and ma[k] != mb.get(k)]
    if a.config.parallel.vocab_multiple != b.config.parallel.vocab_multiple:
        found.append("parallel.vocab_multiple differs")
    if a.vocab_size != b.vocab_size:
        found.append(f"vocabulary {a.vocab_size} vs {b.vocab_size}")
    if a.tokenizer != b.tokenizer:
        found.append("tokenizers differ")
    if set(a.model) != set(b.model):
        only = sorted(set(a.model) ^ set(b.model))
        found.append(f"parameter names differ ({', '.join(only[:3])}{' ...' if len(only) > 3 else ''})")
    else:
        found += [
            f"{n} shape {tuple(a.model[n].shape)} vs {tuple(b.model[n].shape)}"
            for n in a.model
            if a.model[n].shape != b.model[n].shape
        ][:3]
    return found


def _check_finite(model: Consolidated, source: str) -> None:
    """Refuse parameters that are not finite (a diverged run): an average would be NaN too."""
    for name, t in model.model.items():
        if not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{source}: parameter {name} holds NaN or inf")


def average_checkpoints(
    paths: Sequence[str | Path],
    load: Callable[[str | Path], Consolidated] = load_model_file,
) -> Consolidated:
    """The element-wise mean of the parameters of the models at ``paths`` (summed in float64).

    Config, tokenizer and meta come from the last file (the newest, for a run's last
    checkpoints); ``meta["averaged_from"]`` lists the files. One model at a time is
    held besides the sum.
    """
    if not paths:
        raise CheckpointError("no checkpoints to average")
    first = load(paths[0])
    _check_finite(first, str(paths[0]))
    total = {name: t.double().clone() for name, t in first.model.items()}
    last, steps = first, [first.meta.get("step")]
    for path in paths[1:]:
        model = load(path)
        problems = _differences(first, model)
        if problems:
            raise CheckpointError(f"cannot average {paths[0]} with {path}: {'; '.join(problems)}")
        _check_finite(model, str(path))
        for name, t in model.model.items():
            total[name] += t.double()
        last = model
        steps.append(model.meta.get("step"))
    mean = {name: (t / len(paths)).float() for name, t in total.items()}
    meta = {**last.meta, "averaged_from": [str(p) for p in paths], "averaged_steps": steps}
    return dataclasses.replace(last, model=mean, meta=meta)


def last_checkpoints(run_dir: str | Path, count: int, log: Callable[[str], None] = print) -> list[Path]:
    """The ``count`` newest complete checkpoints (step directories) of a run, oldest first.

    Incomplete or torn step directories are skipped, each announced through ``log``
    (an average of other steps than the newest is never silent); fewer than ``count``
    complete ones is a CheckpointError that says how many there are.
    """
    root = checkpoint_root(Path(run_dir))
    complete = []
    for step_dir in list_checkpoints(root):  # newest first
        try:
            check_complete(step_dir, verify=True)
        except CheckpointError as err:
            log(f"checkpoint: skipping {err}")
            continue
        complete.append(step_dir)
        if len(complete) == count:
            return complete[::-1]
    if not root.is_dir():
        raise CheckpointError(f"{run_dir}: no such run directory")
    raise CheckpointError(f"{root}: {len(complete)} complete checkpoints, --last asks for {count}")
