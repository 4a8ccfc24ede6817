"""The model-shape options the decoding benchmarks share, and the random-weight model they describe."""

from __future__ import annotations

import argparse

from megaformer.cli_args import positive_int
from megaformer.config import ModelConfig
from megaformer.model import Transformer
from megaformer.parallel import LOCAL, DropoutRNG


def add_model_arguments(p: argparse.ArgumentParser, layers: int) -> None:
    p.add_argument("--d-model", type=positive_int, default=256)
    p.add_argument("--d-ff", type=positive_int, default=1024)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--layers", type=positive_int, default=layers, help="encoder and decoder layers each")
    p.add_argument("--vocab", type=positive_int, default=8000)
    p.add_argument("--norm", choices=("post", "pre"), default="post", help="post- or pre-LN layers (model.norm)")


def model_config(args: argparse.Namespace, max_positions: int) -> ModelConfig:
    """The shape the options give, without dropout (the benchmarks decode)."""
    return ModelConfig(
        d_model=args.d_model,
        d_ff=args.d_ff,
        num_heads=args.heads,
        encoder_layers=args.layers,
        decoder_layers=args.layers,
        dropout=0.0,
        max_positions=max_positions,
        norm=args.norm,
    )


def random_model(cfg: ModelConfig, vocab: int) -> Transformer:
    """An unsplit model of ``cfg`` from seed 1."""
    return Transformer(cfg, vocab, LOCAL, DropoutRNG(1, LOCAL), seed=1)
