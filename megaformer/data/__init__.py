"""The data pipeline: parallel text -> cleaned pairs -> shared sentencepiece -> webdataset shards -> token batches.

``corpus`` reads and filters text (``wmt``: WMT's archives and SGML, read in place), ``tokenizer`` trains or loads sentencepiece, ``shards``
writes and reads the shard format and manifest, ``stream`` turns shards into resumable,
rank-split, length-grouped batches, ``synthetic`` generates the built-in demo corpus.
``prepare`` and ``inspect`` are the command-line entry points.

Importing this package imports nothing heavy; import the submodules you need.
"""
