"""CTranslate2: the HF Marian directory converted by CTranslate2's own converter, corrected in two places.

CTranslate2's Marian loader assumes two Helsinki-NLP conventions that megaformer does not
share: the decoder starts from a zero embedding (``start_from_zero_embedding``) whatever the
start token, and the table's last row is an appended ``<pad>`` to drop. megaformer's decoder
starts from bos's (trained) embedding and every row is a real piece. The loader here is the
stock Marian loader without those two steps, with ``<s>`` as the start token and Marian's
LayerNorm epsilon 1e-5; weights, positions and vocabulary are read by CTranslate2's own code.

A pre-LN model (``model.norm: pre``), which Marian cannot hold, goes the same way: its layers
through the Marian directory, and its final LayerNorm of each stack attached to the loaded model
where CTranslate2's BART loader reads one (``layer_norm``), with ``pre_norm`` set in the spec.

Sources are given to ``Translator.translate_batch`` as sentencepiece pieces followed by
``</s>`` (as megaformer and MarianTokenizer encode); ``<pad>`` and ``<s>`` should be
suppressed (``suppress_sequences=[["<pad>"], ["<s>"]]``), as megaformer never outputs them,
and ``min_decoding_length=0`` lets it end at once as megaformer may (its default is 1).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from megaformer.checkpoint import Consolidated
from megaformer.config import to_dict
from megaformer.export.hf import no_sacremoses_warning, write_hf_dir
from megaformer.export.marian import BOS_ID, EOS_ID, MARIAN_LAYERNORM_EPS, SPECIAL_PIECES, UNK_ID, final_norm_state
from megaformer.export.safetensors_format import write_manifest

FORMAT = "megaformer-ctranslate2-v1"
SUPPRESS = [["<pad>"], ["<s>"]]


def _converter(hf_dir: Path, final_norms: dict[str, dict[str, torch.Tensor]]):
    """CTranslate2's TransformersConverter with its Marian loader adapted to megaformer's conventions.

    The stock loader also drops the table's last row, assuming Helsinki-NLP's appended
    ``<pad>``; megaformer's pad is id 0 and every row is a real piece, so nothing is dropped.
    ``final_norms`` (:func:`~megaformer.export.marian.final_norm_state`; empty for post-LN) makes
    the layers pre-LN and ends each stack with its LayerNorm.
    """
    from ctranslate2.converters import TransformersConverter
    from ctranslate2.converters.transformers import BartLoader, MarianMTLoader

    class FromBosLoader(MarianMTLoader):
        def get_model_spec(self, model):
            model.config.normalize_before = bool(final_norms)
            model.config.normalize_embedding = False
            for stack, state in final_norms.items():
                norm = torch.nn.LayerNorm(model.config.d_model, eps=MARIAN_LAYERNORM_EPS)
                norm.load_state_dict(state)
                getattr(model.model, stack).layer_norm = norm
            return BartLoader.get_model_spec(self, model)

        def set_decoder(self, spec, decoder):
            BartLoader.set_decoder(self, spec, decoder)
            spec.start_from_zero_embedding = False

        def set_config(self, config, model, tokenizer):
            config.unk_token = SPECIAL_PIECES[UNK_ID]
            config.eos_token = SPECIAL_PIECES[EOS_ID]
            config.bos_token = config.decoder_start_token = SPECIAL_PIECES[BOS_ID]
            config.layer_norm_epsilon = MARIAN_LAYERNORM_EPS

    class FromBosConverter(TransformersConverter):
        def _load(self):
            from transformers import MarianMTModel, MarianTokenizer

            model = MarianMTModel.from_pretrained(self._model_name_or_path, dtype=torch.float32)
            with no_sacremoses_warning():
                tokenizer = MarianTokenizer.from_pretrained(self._model_name_or_path)
            with torch.no_grad():
                return FromBosLoader()(model, tokenizer)

    return FromBosConverter(str(hf_dir))


def write_ct2_dir(folder: Path, model: Consolidated) -> None:
    """The CTranslate2 model (float32) and the sentencepiece model in ``folder``, then the manifest."""
    with tempfile.TemporaryDirectory(prefix="megaformer-ct2-") as tmp:
        hf_dir = Path(tmp) / "hf"
        hf_dir.mkdir()
        write_hf_dir(hf_dir, model, final_norms=True)
        _converter(hf_dir, final_norm_state(model)).convert(str(folder), force=True)
        (folder / "source.spm").write_bytes((hf_dir / "source.spm").read_bytes())
    extra = {"config": to_dict(model.config), "vocab_size": model.vocab_size, "meta": model.meta}
    write_manifest(folder, FORMAT, extra)
