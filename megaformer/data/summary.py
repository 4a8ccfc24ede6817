"""What a prepared directory holds, and how well it batches (``megaformer inspect DIR`` prints it).

:func:`summarize` gives, per split: lines read, kept and rejected by reason, samples,
tokens, shards; a histogram of token lengths; the share of padding in the batches the
training stream would build for one epoch at ``max_tokens`` (both sides, eos/bos included, one DP rank), as one
dict (keys per split include ``read``, ``kept``, ``rejected`` and ``padding_waste``).
``verify`` also reads every shard through and checks its sample count, sha256, token
ids and lengths (the lengths index's sha256 is checked whenever a split is opened);
``spm`` checks that the data was made with that sentencepiece model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megaformer.config import DataConfig
from megaformer.data.manifest import manifest_path, read_manifest
from megaformer.data.shards import verify_split
from megaformer.data.stream import PlanSettings, open_prepared, padding_waste, plan_epoch
from megaformer.errors import DataError

BIN_WIDTH = 8


def summarize(path: str, max_tokens: int, sort_buffer: int, verify: bool = False, spm: str | None = None) -> dict:
    """The report as a dict (what ``megaformer inspect --json`` prints)."""
    mpath = manifest_path(path)
    manifest = read_manifest(mpath)
    defaults = DataConfig()
    summary = {
        "dir": str(mpath.parent),
        "src_lang": manifest["src_lang"],
        "tgt_lang": manifest["tgt_lang"],
        "tokenizer": manifest["tokenizer"],
        "max_tokens": max_tokens,
        "splits": {},
    }
    for name, entry in manifest["splits"].items():
        data = open_prepared(mpath, name, spm=spm)
        settings = PlanSettings(
            dp_size=1,
            max_tokens=max_tokens,
            max_len=0,
            shuffle_buffer=defaults.shuffle_buffer,
            sort_buffer=sort_buffer,
            seed=defaults.seed,
            shuffle=name == "train",
        )
        need = int(data.lengths.max(initial=0)) + 1  # the longest sample with eos: one batch must hold it
        if len(data.lengths) and need > max_tokens:
            raise DataError(
                f"--max-tokens {max_tokens} cannot hold the longest {name} sample ({need} tokens with eos): "
                f"give at least {need} (training takes a smaller data.max_tokens only with a data.max_len that "
                f"leaves the longer samples out)"
            )
        batches = plan_epoch(data, settings, epoch=0)[0].batches if len(data.lengths) else []
        bins = int(data.lengths.max(initial=0)) // BIN_WIDTH + 1
        summary["splits"][name] = {
            "read": entry["read"],
            "kept": entry["kept"],
            "rejected": entry["rejected"],
            "samples": entry["samples"],
            "src_tokens": entry.get("src_tokens"),
            "tgt_tokens": entry.get("tgt_tokens"),
            "shards": len(entry["shards"]),
            "batches": len(batches),
            "padding_waste": round(padding_waste(batches, data.lengths), 5),
            "length_histogram": {
                "bin_width": BIN_WIDTH,
                "src": np.bincount(data.lengths[:, 0] // BIN_WIDTH, minlength=bins).tolist(),
                "tgt": np.bincount(data.lengths[:, 1] // BIN_WIDTH, minlength=bins).tolist(),
            },
        }
        for url in data.urls:  # cheap, so always: a deleted shard is noticed without --verify
            if not Path(url).is_file():
                raise DataError(f"{url}: listed in {mpath} but missing (run megaformer prepare again)")
        if verify:  # the lengths index's sha256 was checked when the split was opened
            verify_split(data)
    return summary
