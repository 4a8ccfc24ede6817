"""The encoder-decoder Transformer built from the parallel core."""

from megaformer.model.attention import DecoderCache
from megaformer.model.shape import shape_model
from megaformer.model.transformer import Transformer, sinusoidal_positions

__all__ = ["DecoderCache", "Transformer", "shape_model", "sinusoidal_positions"]
