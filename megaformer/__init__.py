"""megaformer: the encoder-decoder Transformer of "Attention Is All You Need" at cluster scale."""

__version__ = "0.1.0"
