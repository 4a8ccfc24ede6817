"""From a model file to a model and a tokenizer ready to decode, at any TP size.

:func:`load_model_file` is the one place where the decode commands (and ``export``) read a
model: a consolidated model file, a training checkpoint's step directory, a run directory
(its newest complete checkpoint), or an export of ``megaformer export`` (safetensors file
or directory, Hugging Face Marian directory), whose sha256 sums are checked. The path is
located once (:func:`megaformer.checkpoint.locate`); a located source is read as it is.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import sentencepiece as spm
import torch

from megaformer.checkpoint import CheckpointSource, Consolidated, locate, read_model
from megaformer.data.tokenizer import check_special_ids
from megaformer.errors import CheckpointError
from megaformer.model import Transformer
from megaformer.parallel import DropoutRNG, TPGroup, check_model_split, load_full_state

LOG = logging.getLogger(__name__)


def load_model_file(path: str | Path | CheckpointSource, log: Callable[[str], None] | None = None) -> Consolidated:
    """The TP-independent model at ``path``: model file, step directory, run directory, or an export.

    ``path`` may be a source :func:`~megaformer.checkpoint.locate` found: its files verified
    then are not hashed again. Exports (:mod:`megaformer.export`) are read with safetensors
    and their sha256 checked: a ``.safetensors`` file, a safetensors export directory, a
    Hugging Face Marian directory written by ``megaformer export --format hf``. A checkpoint's
    weights are read alone, never its Adam moments. A run directory whose newest checkpoint
    is damaged falls back to an older one, announced through ``log`` (stderr by default).
    CheckpointError if ``path`` is missing, torn, damaged or of another kind.
    """
    source = path if isinstance(path, CheckpointSource) else locate(path, log or _to_stderr)
    if source.kind == "export":
        return load_export(source.path)
    return read_model(source)


def _to_stderr(message: str) -> None:
    """A checkpoint skipped, or an older one used: said under -q too."""
    LOG.warning(message)


def load_export(path: Path) -> Consolidated | None:
    """The model of an export at ``path``, or None if ``path`` is not one (see :func:`load_model_file`)."""
    manifest = path / "megaformer-export.json"
    if path.is_file() and path.suffix == ".safetensors":
        from megaformer.export.safetensors_format import load_safetensors_export

        return load_safetensors_export(path)
    if not (path.is_dir() and manifest.is_file()):
        return None
    from megaformer.export.safetensors_format import field_of

    try:
        record = json.loads(manifest.read_text())
    except (OSError, ValueError):
        raise CheckpointError(f"{manifest}: unreadable export manifest") from None
    kind = field_of(record, "format", str, manifest)  # a hand-edited field of the wrong type: one line naming it
    if kind == "megaformer-hf-marian-v1":
        from megaformer.export.hf import load_hf_export

        return load_hf_export(path)
    if kind == "megaformer-safetensors-v1":
        from megaformer.export.safetensors_format import load_safetensors_export

        return load_safetensors_export(path)
    raise CheckpointError(
        f"{path}: a {kind} export, which megaformer does not read back; use its hf or safetensors export"
    )


def check_layout(model: Consolidated, tp_size: int, *, source: str = "") -> None:
    """Reject a TP size the model cannot be split over, before any process starts."""
    cfg = model.config
    check_model_split(cfg.model, tp_size, "--tp")
    embed = model.model.get("embed.weight")  # its padding is fitted to the TP size as it is split
    if embed is not None and embed.shape[0] < model.vocab_size:
        raise CheckpointError(
            f"{source}: the embedding has {embed.shape[0]} rows, fewer than the vocabulary's {model.vocab_size}"
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
    check_special_ids(sp, source)
    if sp.vocab_size() != model.vocab_size:
        raise CheckpointError(f"{source}: tokenizer has {sp.vocab_size()} pieces, the model {model.vocab_size}")
    return sp
