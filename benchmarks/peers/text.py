"""The data every system of the comparison reads: megaformer's prepared Multi30k, and the same pairs as pieces.

:func:`prepare` runs the Multi30k recipe's own ``megaformer prepare`` step into WORK/data (once), then writes
WORK/text: ``train.{en,de}`` and ``valid.{en,de}`` read back from the prepared shards as space-separated
sentencepiece pieces (the cleaned pairs and their segmentation, not a second cleaning), ``test.en`` (the test
source through the same sentencepiece model, as ``megaformer translate`` encodes it), the vocabulary as fairseq's
``dict.txt`` and OpenNMT-py's ``vocab.txt`` (every piece but the special ones, with its training count).
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from megaformer.data.shards import open_prepared, read_shard
from megaformer.recipes import multi30k as m30k


@dataclass(frozen=True)
class Shared:
    data: Path  # megaformer's prepared directory
    text: Path  # the pieces (train/valid/test), dict.txt, vocab.txt
    spm: Path
    test_lines: int
    test_mean_pieces: float  # the mean length of the test sources in pieces (+ eos): for fairseq's length penalty
    test_max_pieces: int
    train_pairs: int


def _write_split(prepared: Path, split: str, pieces: list[str], out: Path, counts: Counter) -> int:
    data = open_prepared(prepared, split)
    n = 0
    with open(out / f"{split}.en", "w", encoding="utf-8") as fs, open(out / f"{split}.de", "w", encoding="utf-8") as ft:
        for url, size in zip(data.urls, data.shard_sizes, strict=True):
            for _, src, tgt in read_shard(url, expected=size):
                s, t = [pieces[i] for i in src.tolist()], [pieces[i] for i in tgt.tolist()]
                counts.update(s)
                counts.update(t)
                fs.write(" ".join(s) + "\n")
                ft.write(" ".join(t) + "\n")
                n += 1
    return n


def prepare(data: Path, work: Path, test: str) -> Shared:
    """WORK/data (the recipe's prepare step) and WORK/text, each made once; the paths and the test's lengths."""
    import sentencepiece as spm

    recipe = m30k.Multi30k(data=data, work=work, tests=(test,))
    prepared, out = work / "data", work / "text"
    if not (prepared / "manifest.json").is_file():
        m30k.steps(recipe, m30k.Machine(gpus=0, native_bf16=False))[0].run()  # the same prepare on every machine
    model = prepared / "spm.model"
    sp = spm.SentencePieceProcessor(model_file=str(model))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    done = out / "done.json"
    made_from = {"data": str(data), "test": test}
    if done.is_file() and {k: json.loads(done.read_text()).get(k) for k in made_from} != made_from:
        raise SystemExit(f"{out} was made from other data or another test set ({done}): use another --work")
    if not done.is_file():
        out.mkdir(parents=True, exist_ok=True)
        counts: Counter = Counter()
        sizes = {split: _write_split(prepared, split, pieces, out, counts if split == "train" else Counter())
                 for split in ("train", "valid")}  # fmt: skip
        with _open_text(m30k.data_side(data, test, "en")) as f:
            sources = [sp.encode(line.rstrip("\n"), out_type=str) for line in f]
        (out / "test.en").write_text("".join(" ".join(s) + "\n" for s in sources), encoding="utf-8")
        special = {sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()}
        vocab = [p for i, p in enumerate(pieces) if i not in special]
        (out / "dict.txt").write_text("".join(f"{p} {counts[p]}\n" for p in vocab), encoding="utf-8")
        (out / "vocab.txt").write_text("".join(f"{p}\t{counts[p]}\n" for p in vocab), encoding="utf-8")
        lengths = [len(s) + 1 for s in sources]
        stats = {**made_from, "pairs": sizes, "test_lines": len(lengths),
                 "test_mean_pieces": sum(lengths) / len(lengths),
                 "test_max_pieces": max(lengths)}  # fmt: skip
        done.write_text(json.dumps(stats) + "\n")
    stats = json.loads(done.read_text())
    return Shared(
        prepared, out, model, stats["test_lines"], stats["test_mean_pieces"], stats["test_max_pieces"],
        stats["pairs"]["train"],
    )  # fmt: skip


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def detokenize(spm_model: Path, lines: list[str]) -> list[str]:
    """Pieces back to text with the sentencepiece model (what ``megaformer translate`` writes)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(spm_model))
    return [sp.decode_pieces(line.split()) for line in lines]
