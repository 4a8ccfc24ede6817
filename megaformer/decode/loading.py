"""From a model file to a model and a tokenizer ready to decode, at any TP size.

:func:`load_model_file` is the one place where the decode commands read a model: a
consolidated model file, a training checkpoint's step directory, or a run directory
(its newest complete checkpoint), through ``checkpoint.load_for_inference``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import sentencepiece as spm
import torch

from megaformer.errors import CheckpointError
from megaformer.model import Transformer
from megaformer.parallel import DropoutRNG, TPGroup, check_model_split, load_full_state, padded_vocab_size
from megaformer.train.checkpoint import Consolidated, load_for_inference

SPECIAL_IDS = {"pad": 0, "unk": 1, "bos": 2, "eos": 3}


def load_model_file(path: str | Path) -> Consolidated:
    """The TP-independent model at ``path`` (model file, step directory or run directory).

    CheckpointError if it is missing, torn or of another kind. Skipping a damaged
    newest checkpoint for an older one is said on stderr.
    """
    return load_for_inference(path, log=lambda message: print(message, file=sys.stderr))


def check_layout(model: Consolidated, tp_size: int, *, source: str = "") -> None:
    """Reject a TP size the model cannot be split over, before any process starts."""
    cfg = model.config
    check_model_split(cfg.model, tp_size)
    padded = padded_vocab_size(model.vocab_size, tp_size, cfg.parallel.vocab_multiple)
    embed = model.model.get("embed.weight")
    if embed is not None and embed.shape[0] != padded:
        raise CheckpointError(
            f"{source}: the embedding has {embed.shape[0]} rows; vocabulary {model.vocab_size} padded for "
            f"tp={tp_size} needs {padded}: decode with a TP size whose padding matches the training run's"
        )


def build_model(
    model: Consolidated, tp: TPGroup, device: torch.device | str = "cpu", *, source: str = ""
) -> Transformer:
    """A Transformer holding this rank's slices of ``model``'s parameters, in eval mode.

    ``source`` names the file in error messages. A shape that does not split over
    ``tp`` is a ConfigError; parameters that do not fit the config a CheckpointError.
    """
    check_layout(model, tp.size, source=source)
    cfg = model.config
    net = Transformer(cfg.model, model.vocab_size, tp, DropoutRNG(0, tp), vocab_multiple=cfg.parallel.vocab_multiple)
    try:
        load_full_state(net, model.model, tp)
    except ValueError as err:
        raise CheckpointError(f"{source}: {err}") from None
    return net.to(device).eval()


def load_tokenizer(model: Consolidated, *, source: str = "") -> spm.SentencePieceProcessor:
    """The sentencepiece model stored with ``model``, checked against its vocabulary and special ids."""
    if not model.tokenizer:
        raise CheckpointError(f"{source}: holds no tokenizer; it cannot translate raw text")
    try:
        sp = spm.SentencePieceProcessor(model_proto=model.tokenizer)
    except (RuntimeError, OSError, TypeError):
        raise CheckpointError(f"{source}: its tokenizer bytes are not a sentencepiece model") from None
    found = {"pad": sp.pad_id(), "unk": sp.unk_id(), "bos": sp.bos_id(), "eos": sp.eos_id()}
    if found != SPECIAL_IDS:
        raise CheckpointError(f"{source}: tokenizer special ids {found}, megaformer needs {SPECIAL_IDS}")
    if sp.vocab_size() != model.vocab_size:
        raise CheckpointError(f"{source}: tokenizer has {sp.vocab_size()} pieces, the model {model.vocab_size}")
    return sp
