"""Small trained models for the decoding tests: reversal of id sequences and of sentences.

A few hundred Adam steps on one thread teach a tiny Transformer to reverse its input,
enough for beam search to meet real decisions (eos at varied lengths, beams that
disagree with greedy) and for BLEU to be far above 0.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
import torch

from megaformer.config import Config, ModelConfig
from megaformer.model import Transformer
from megaformer.parallel import LOCAL, DropoutRNG, TPGroup, gather_full_state, load_full_state

PAD, BOS, EOS = 0, 2, 3
TINY = ModelConfig(d_model=32, d_ff=64, num_heads=4, encoder_layers=2, decoder_layers=2, dropout=0.0, max_positions=64)
WORDS = (
    "red green blue cat dog bird one two three big small fast slow tree house river "
    "stone cloud rain sun moon star fish boat"
).split()


def collate(pairs: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(src + eos, bos + tgt, tgt + eos), right-padded."""
    s_len = max(len(s) for s, _ in pairs) + 1
    t_len = max(len(t) for _, t in pairs) + 1
    src = torch.zeros(len(pairs), s_len, dtype=torch.long)
    tgt_in = torch.zeros(len(pairs), t_len, dtype=torch.long)
    tgt_out = torch.zeros(len(pairs), t_len, dtype=torch.long)
    for i, (s, t) in enumerate(pairs):
        src[i, : len(s)], src[i, len(s)] = torch.tensor(s), EOS
        tgt_in[i, 0], tgt_in[i, 1 : len(t) + 1] = BOS, torch.tensor(t, dtype=torch.long)
        tgt_out[i, : len(t)], tgt_out[i, len(t)] = torch.tensor(t, dtype=torch.long), EOS
    return src, tgt_in, tgt_out


def random_ids(rng: random.Random, vocab: int, lo: int = 2, hi: int = 10) -> list[int]:
    return [rng.randrange(4, vocab) for _ in range(rng.randint(lo, hi))]


def train(model: Transformer, batches, steps: int, lr: float = 3e-3) -> Transformer:
    """``steps`` Adam steps on ``batches()`` (a callable giving one batch), on one thread; returns model.eval()."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98))
        model.train()
        for _ in range(steps):
            loss, n = model.loss(*batches(), label_smoothing=0.1)
            opt.zero_grad()
            (loss / n).backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval()


@functools.lru_cache(maxsize=4)
def reverse_id_state(vocab: int = 100, steps: int = 150, seed: int = 3) -> dict[str, torch.Tensor]:
    """TP=1 parameters of TINY trained ``steps`` steps to reverse random id sequences (partly trained)."""
    rng = random.Random(seed)
    model = Transformer(TINY, vocab, LOCAL, DropoutRNG(seed, LOCAL), seed=seed)

    def batches():
        ids = [random_ids(rng, vocab) for _ in range(32)]
        return collate([(x, x[::-1]) for x in ids])

    return gather_full_state(train(model, batches, steps), LOCAL)


def model_from_state(
    state: dict[str, torch.Tensor], vocab: int, tp: TPGroup = LOCAL, cfg: ModelConfig = TINY
) -> Transformer:
    """A model at ``tp`` holding the TP=1 ``state`` (built from another seed: the state must be what counts)."""
    model = Transformer(cfg, vocab, tp, DropoutRNG(11, tp), seed=11)
    load_full_state(model, state, tp)
    return model.eval()


def reverse_sentence(line: str) -> str:
    return " ".join(line.split()[::-1])


def random_sentence(rng: random.Random, lo: int = 2, hi: int = 7) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def make_text_checkpoint(
    folder: Path,
    steps: int = 300,
    seed: int = 5,
    name: str = "model.pt",
    snapshots: tuple[int, ...] = (),
    norm: str = "post",
) -> dict[str, Path]:
    """Train sentencepiece and TINY-64 on sentence reversal; write consolidated files into ``folder``.

    ``norm``: the layers' ``model.norm`` (post- or pre-LN). Returns {"final": path, step: path for each snapshot step}.
    """
    from megaformer.checkpoint import Consolidated, save_consolidated
    from megaformer.data.tokenizer import train_bpe

    rng = random.Random(seed)
    text = folder / "spm_train.txt"
    text.write_text("\n".join(random_sentence(rng) for _ in range(2000)) + "\n")
    spm_path = folder / "spm.model"
    train_bpe([text], spm_path, vocab_size=60, seed=seed)
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(spm_path))
    vocab = sp.vocab_size()
    cfg = Config()
    cfg.model = ModelConfig(
        d_model=64, d_ff=128, num_heads=4, encoder_layers=2, decoder_layers=2, dropout=0.0, max_positions=64, norm=norm
    )
    model = Transformer(cfg.model, vocab, LOCAL, DropoutRNG(seed, LOCAL), seed=seed)

    def batches():
        lines = [random_sentence(rng) for _ in range(32)]
        return collate([(sp.encode(x), sp.encode(reverse_sentence(x))) for x in lines])

    paths: dict = {}
    tokenizer = spm_path.read_bytes()
    done = 0
    for stop in sorted(set(snapshots) | {steps}):
        train(model, batches, stop - done)
        done = stop
        path = folder / (name if stop == steps else f"step{stop}.pt")
        save_consolidated(path, Consolidated(cfg, gather_full_state(model, LOCAL), vocab, tokenizer, {"step": stop}))
        paths["final" if stop == steps else stop] = path
    return paths


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models decode fastest on one thread (and OpenMP waits badly on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
