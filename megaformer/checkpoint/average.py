"""Averaging checkpoints (the paper, section 6.1): the element-wise mean of the last checkpoints' parameters.

Models with different configs (dropout aside: it does not change what the weights
compute), vocabularies, tokenizers or parameter shapes are refused, naming both files.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from megaformer.checkpoint.consolidated import Consolidated
from megaformer.checkpoint.format import checkpoint_root, list_checkpoints, verify_all
from megaformer.config import TRAINING_ONLY_MODEL_SETTINGS, to_dict
from megaformer.errors import CheckpointError

LOG = logging.getLogger(__name__)

# ---- checkpoint averaging -------------------------------------------------------------------


def _differences(a: Consolidated, b: Consolidated) -> list[str]:
    """What keeps ``a`` and ``b`` from being averaged, as short phrases."""
    found = []
    ma, mb = to_dict(a.config)["model"], to_dict(b.config)["model"]
    found += [
        f"model.{k} {ma[k]!r} vs {mb[k]!r}" for k in ma if k not in TRAINING_ONLY_MODEL_SETTINGS and ma[k] != mb.get(k)
    ]
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


def _held(model: Consolidated) -> set[tuple[int, str]]:
    """The training checkpoints a model holds, as its meta records them: (step, the run's checkpoints folder with
    links resolved); an average holds each of its steps (taken to be of the run of its newest); empty where the
    meta records none."""
    step, source = model.meta.get("step"), model.meta.get("source")
    if not isinstance(source, str) or not source:
        return set()
    folder = os.path.dirname(os.path.realpath(source))
    steps = model.meta.get("averaged_steps") if "averaged_from" in model.meta else [step]
    return {(s, folder) for s in steps or () if isinstance(s, int) and not isinstance(s, bool)}


def average_checkpoints(
    paths: Sequence[str | Path],
    load: Callable[[str | Path], Consolidated],
) -> Consolidated:
    """The element-wise mean of the parameters of the models at ``paths`` (summed in float64).

    ``load`` reads one path as a :class:`Consolidated` model (a checkpoint, a model file,
    an export: :func:`megaformer.decode.loading.load_model_file`, or the average command's).

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
    held = dict.fromkeys(_held(first), paths[0])
    for path in paths[1:]:
        model = load(path)
        problems = _differences(first, model)
        if problems:
            raise CheckpointError(f"cannot average {paths[0]} with {path}: {'; '.join(problems)}")
        for step, folder in sorted(_held(model)):
            if (twin := held.setdefault((step, folder), path)) is not path:
                raise CheckpointError(
                    f"{path}: made from the same checkpoint as {twin} (step {step}, {folder}): it would weigh "
                    f"twice in the average; name each checkpoint once (an average holds each of its steps)"
                )
        _check_finite(model, str(path))
        for name, t in model.model.items():
            total[name] += t.double()
        last = model
        steps.append(model.meta.get("step"))
    mean = {name: (t / len(paths)).float() for name, t in total.items()}
    meta = {**last.meta, "averaged_from": [str(p) for p in paths], "averaged_steps": steps}
    return dataclasses.replace(last, model=mean, meta=meta)


def last_checkpoints(
    run_dir: str | Path,
    count: int,
    log: Callable[[str], None] = LOG.info,
    asked_by: str = "--last",
    check: Callable[[Path], object] = verify_all,
) -> list[Path]:
    """The ``count`` newest complete checkpoints (step directories) of a run, oldest first.

    Incomplete or torn step directories are skipped, each announced through ``log``
    (an average of other steps than the newest is never silent); fewer than ``count``
    complete ones is a CheckpointError that says how many there are and what asked for
    ``count`` (``asked_by``: the option, or the setting it defaulted to). ``check``: what
    makes a step usable (every file's sha256 by default; a
    :class:`megaformer.checkpoint.source.SourceCheck` verifies what the average reads and keeps it).
    """
    root = checkpoint_root(Path(run_dir))
    complete = []
    for step_dir in list_checkpoints(root):  # newest first
        try:
            check(step_dir)
        except CheckpointError as err:
            log(f"checkpoint: skipping {err}")
            continue
        complete.append(step_dir)
        if len(complete) == count:
            return complete[::-1]
    if not root.is_dir():
        raise CheckpointError(f"{run_dir}: no such run directory")
    fewer = "" if asked_by == "--last" else f": pass --last {max(len(complete), 1)}"
    raise CheckpointError(f"{root}: {len(complete)} complete checkpoints, {asked_by} asks for {count}{fewer}")
