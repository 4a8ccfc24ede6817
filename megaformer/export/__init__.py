"""Models that other tools load: safetensors (our names), Hugging Face MarianMT, CTranslate2.

Every export is written into a temporary path beside its destination and renamed into
place at the end; a manifest records the sha256 of every file written, and every reader
here verifies it. Nothing here unpickles: weights are read with safetensors.

* :mod:`megaformer.export.safetensors_format`: the consolidated model as safetensors,
  one self-contained file or a directory (weights, config, tokenizer, manifest).
* :mod:`megaformer.export.marian`: the exact mapping onto ``MarianMTModel`` and
  ``MarianTokenizer``, or a one-line refusal of what Marian cannot express.
* :mod:`megaformer.export.ct2`: CTranslate2, through its own converter from the HF directory
  (pre-LN models too: their final LayerNorms are handed to it beside the directory).
* :mod:`megaformer.export.write`: writing one of them through a staged path, and what an output name says;
  the command is :mod:`megaformer.commands.export`.
"""

from __future__ import annotations

from megaformer.errors import MegaformerError


class ExportError(MegaformerError):
    """A model that a format cannot express exactly, or an output that must not be written."""
