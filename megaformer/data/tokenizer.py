"""Train or load the one sentencepiece BPE model shared by source and target (paper, 5.1).

The special ids are fixed for the whole code base: pad=0, unk=1, bos=2, eos=3, defined
here and nowhere else (every other module imports them, or reads them from a
:class:`Tokenizer`; :func:`check_special_ids` is the one check of a loaded model). A model
made elsewhere is accepted only if it uses the same ids (otherwise padding would be a
real token). Training is deterministic: one thread and a fixed sampling seed give a
byte-identical model for the same text.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import sentencepiece as spm

from megaformer.errors import DataError
from megaformer.files import sha256_of

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
SPECIAL_IDS: dict[str, int] = {"pad_id": PAD_ID, "unk_id": UNK_ID, "bos_id": BOS_ID, "eos_id": EOS_ID}


def train_bpe(
    inputs: Sequence[Path],
    model_path: Path,
    vocab_size: int,
    *,
    seed: int,
    max_sentences: int = 0,
    character_coverage: float = 1.0,
    setting: str = "--vocab-size",
    described_as: str = "the training text",
) -> None:
    """Train a BPE model on the text files ``inputs`` (one sentence a line) into ``model_path``.

    ``max_sentences`` > 0 trains on a seeded random sample of that many sentences (large
    corpora); 0 uses every sentence. A vocabulary the text cannot fill is a DataError that
    names ``setting`` and the largest size that works.
    """
    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    try:
        # Sentences and model go through Python objects, not file names: the model records
        # its trainer's file names, and ours live in a randomly named temporary directory.
        spm.SentencePieceTrainer.train(
            sentence_iterator=_sentences(inputs),
            model_writer=model,
            model_type="bpe",
            vocab_size=vocab_size,
            character_coverage=character_coverage,
            input_sentence_size=max_sentences,
            shuffle_input_sentence=max_sentences > 0,
            num_threads=1,  # more threads change the merges from run to run
            minloglevel=2,
            **SPECIAL_IDS,
        )
    except RuntimeError as err:
        message = str(err)
        too_high = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", message)
        if too_high:
            raise DataError(
                f"{setting} {vocab_size} is larger than {described_as} supports "
                f"(at most {too_high.group(2)}): lower {setting}"
            ) from None
        reason = message.split("] ", 1)[-1].strip() or message.strip()
        if "sentences_.empty()" in message:  # every sentence over its max_sentence_length: skipped, said nowhere
            reason = (
                "no sentence of at most 4,192 bytes, the longest sentencepiece trains on: are the lines whole texts?"
            )
        too_low = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)\.", message)
        if too_low:  # sentencepiece's own advice names its own flag, not megaformer's option
            reason = (
                f"{too_low.group(2)} pieces are needed for the text's characters at --character-coverage "
                f"{character_coverage} and the special pieces: raise {setting} to at least {too_low.group(2)}, or "
                f"lower --character-coverage"
            )
        raise DataError(f"sentencepiece cannot train on {described_as} with {setting} {vocab_size}: {reason}") from None
    model_path.write_bytes(model.getvalue())


def _sentences(paths: Sequence[Path]) -> Iterator[str]:
    for path in paths:
        with open(path, encoding="utf-8", newline="\n") as f:
            for line in f:
                yield line.rstrip("\n")


def check_special_ids(processor: spm.SentencePieceProcessor, source: str) -> None:
    """DataError naming ``source`` unless ``processor`` uses megaformer's pad/unk/bos/eos ids."""
    found = {
        "pad_id": processor.pad_id(),
        "unk_id": processor.unk_id(),
        "bos_id": processor.bos_id(),
        "eos_id": processor.eos_id(),
    }
    if found != SPECIAL_IDS:
        wanted = " ".join(f"{k}={v}" for k, v in SPECIAL_IDS.items())
        got = " ".join(f"{k}={v}" for k, v in found.items())
        raise DataError(
            f"{source}: special ids {got}; megaformer needs {wanted} (train with these sentencepiece options)"
        )


class Tokenizer:
    """A loaded sentencepiece model with the special ids checked, plus its file and sha256."""

    pad_id, unk_id, bos_id, eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(f"{self.path}: no such sentencepiece model")
        self.processor = spm.SentencePieceProcessor()
        try:
            self.processor.Load(str(self.path))
        except (OSError, RuntimeError):
            raise DataError(f"{self.path}: not a sentencepiece model") from None
        check_special_ids(self.processor, str(self.path))
        self.sha256 = sha256_of(self.path)

    @property
    def vocab_size(self) -> int:
        return self.processor.vocab_size()

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without bos/eos (the stream adds them)."""
        return self.processor.encode(texts)

    def encode_sampled(self, texts: list[str], dropout: float, seed: int) -> list[list[int]]:
        """One BPE-dropout segmentation of each text (Provilkov et al., 2020): every merge is
        skipped with probability ``dropout``, so a word may come out in smaller pieces of the
        same vocabulary. The same ``seed`` gives the same segmentations: a batch call starts
        sentencepiece's sampler afresh from its global seed, so each call needs its own.
        """
        spm.set_random_generator_seed(seed)
        return self.processor.encode(texts, enable_sampling=True, alpha=dropout, nbest_size=-1, num_threads=1)

    def decode(self, ids: Sequence[int]) -> str:
        """Detokenized text of ids; pad, bos and eos are dropped, decoding stops at the first eos."""
        ids = list(ids)
        if EOS_ID in ids:
            ids = ids[: ids.index(EOS_ID)]
        return self.processor.decode([i for i in ids if i not in (PAD_ID, BOS_ID)])

    def describe(self) -> dict:
        """What the manifest records about the tokenizer (the file name is relative to the data dir)."""
        return {"file": self.path.name, "sha256": self.sha256, "vocab_size": self.vocab_size, **SPECIAL_IDS}
