"""The model's parameter shapes without its memory: a Transformer built on the ``meta`` device.

Used wherever shapes and split tags are needed but no weights: parameter counts
(``megaformer info``), and merging or re-splitting checkpoint shards.
"""

from __future__ import annotations

import torch

from megaformer.config import Config
from megaformer.model.transformer import Transformer
from megaformer.parallel import DropoutRNG, TPGroup
from megaformer.parallel.stages import StagePart


def shape_model(cfg: Config, vocab_size: int, tp_size: int = 1, part: StagePart | None = None) -> Transformer:
    """The model of ``cfg`` (or its pipeline stage ``part``) at TP size ``tp_size`` (as rank 0 holds it), on the
    meta device."""
    tp = TPGroup(group=None, size=tp_size, rank=0)
    with torch.device("meta"):
        return Transformer(
            cfg.model,
            vocab_size,
            tp,
            DropoutRNG(0, tp),
            sequence_parallel=cfg.parallel.sequence_parallel,
            vocab_multiple=cfg.parallel.vocab_multiple,
            part=part,
        )
