"""Write and read the Hugging Face directory: MarianMTModel weights, MarianTokenizer files, manifest.

The weights go through ``transformers`` itself (``MarianMTModel.load_state_dict`` then
``save_pretrained``), so names, tied tables and the files a loader expects are the
library's own; the mapping is :mod:`megaformer.export.marian`. The manifest
(``megaformer-export.json``) adds megaformer's config, so that ``translate --ckpt DIR``
reads the directory back exactly (the permutation is inverted, the table re-padded).
"""

from __future__ import annotations

import json
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import sentencepiece as spm

from megaformer.checkpoint import Consolidated
from megaformer.config import to_dict
from megaformer.errors import CheckpointError
from megaformer.export import ExportError
from megaformer.export.marian import (
    SPECIAL_PIECES,
    from_marian_state,
    generation_settings,
    marian_config,
    to_marian_state,
)
from megaformer.export.safetensors_format import config_of, field_of, read_manifest, write_manifest
from megaformer.parallel import padded_vocab_size

FORMAT = "megaformer-hf-marian-v1"
POSITION_KEYS = {"model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight"}


def check_tokenizer(model: Consolidated) -> spm.SentencePieceProcessor:
    """The sentencepiece model, if MarianTokenizer can use it as it is (see marian's module docstring)."""
    if not model.tokenizer:
        raise ExportError("the checkpoint holds no tokenizer.model: MarianTokenizer needs one")
    sp = spm.SentencePieceProcessor(model_proto=model.tokenizer)
    pieces = {i: sp.id_to_piece(i) for i in SPECIAL_PIECES}
    if pieces != SPECIAL_PIECES:
        raise ExportError(f"tokenizer special pieces {pieces}; MarianTokenizer needs {SPECIAL_PIECES}")
    if sp.vocab_size() != model.vocab_size:
        raise ExportError(f"tokenizer has {sp.vocab_size()} pieces, the model {model.vocab_size}")
    return sp


def write_hf_dir(folder: Path, model: Consolidated, *, final_norms: bool = False) -> None:
    """``config.json``, ``generation_config.json``, ``model.safetensors``, tokenizer files, manifest.

    ``final_norms``: a pre-LN model's layers are written too, without its final LayerNorms (for
    CTranslate2's converter, which is given those apart: the directory alone is not the model).
    """
    import torch
    from transformers import GenerationConfig, MarianConfig, MarianMTModel

    sp = check_tokenizer(model)
    state = to_marian_state(model, final_norms=final_norms)
    with torch.random.fork_rng(devices=[]):  # its random init is overwritten: leave the caller's stream alone
        net = MarianMTModel(MarianConfig(**marian_config(model)))
    result = net.load_state_dict(state, strict=False)
    if result.unexpected_keys or set(result.missing_keys) - POSITION_KEYS:
        raise ExportError(
            f"mapping does not fit this transformers version's MarianMTModel "
            f"(missing {sorted(set(result.missing_keys) - POSITION_KEYS)[:3]}, unexpected {result.unexpected_keys[:3]})"
        )
    net.generation_config = GenerationConfig(**generation_settings(model))
    net.save_pretrained(str(folder))
    _write_tokenizer(folder, sp, model.tokenizer)
    extra = {"config": to_dict(model.config), "vocab_size": model.vocab_size, "meta": model.meta}
    write_manifest(folder, FORMAT, extra)


def _write_tokenizer(folder: Path, sp: spm.SentencePieceProcessor, proto: bytes) -> None:
    """source.spm, target.spm, vocab.json (piece -> sentencepiece id) and the tokenizer config, by MarianTokenizer."""
    from transformers import MarianTokenizer

    with tempfile.TemporaryDirectory(prefix="megaformer-hf-") as tmp:
        spm_path, vocab_path = Path(tmp) / "source.spm", Path(tmp) / "vocab.json"
        spm_path.write_bytes(proto)
        vocab_path.write_text(json.dumps({sp.id_to_piece(i): i for i in range(sp.vocab_size())}, ensure_ascii=False))
        with no_sacremoses_warning():
            tok = MarianTokenizer(str(spm_path), str(spm_path), str(vocab_path), model_max_length=1 << 30)
        tok.save_pretrained(str(folder))


@contextmanager
def no_sacremoses_warning() -> Iterator[None]:
    """MarianTokenizer asks for sacremoses, whose punctuation normaliser its encoding never calls."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Recommended: pip install sacremoses")
        yield


def is_hf_export(path: Path) -> bool:
    manifest = path / "megaformer-export.json"
    if not (path.is_dir() and manifest.is_file()):
        return False
    try:
        return json.loads(manifest.read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def load_hf_export(folder: Path) -> Consolidated:
    """The megaformer model of a directory written by :func:`write_hf_dir`, checksums verified."""
    from safetensors.torch import load_file

    manifest = read_manifest(folder)
    source = folder / "megaformer-export.json"
    cfg, vocab = config_of(manifest, source), field_of(manifest, "vocab_size", int, source)
    meta = field_of(manifest, "meta", dict, source) if "meta" in manifest else {}
    try:
        state = load_file(str(folder / "model.safetensors"))
    except Exception as err:  # a foreign or hand-edited directory
        raise CheckpointError(
            f"{folder}: cannot be read as a megaformer HF export ({type(err).__name__}: {err})"
        ) from None
    shell = Consolidated(cfg, {}, vocab)
    try:
        params = from_marian_state(state, shell, padded_vocab_size(vocab, 1, cfg.parallel.vocab_multiple))
    except ExportError as err:
        raise CheckpointError(f"{folder}: {err}") from None
    try:
        tokenizer = (folder / "source.spm").read_bytes()
    except OSError as err:
        raise CheckpointError(
            f"{folder / 'source.spm'}: cannot be read ({err.strerror}): export the model again"
        ) from None
    return Consolidated(cfg, params, vocab, tokenizer, meta)
