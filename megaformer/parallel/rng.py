"""Dropout randomness that is correct under tensor parallelism.

Two streams, both :class:`torch.Generator` objects owned by one :class:`DropoutRNG`:

* ``shared``: the same on every rank of a TP group (seeded by seed and DP rank). Masks
  for replicated tensors (residual dropout, embeddings) come from it, so the TP peers
  of a group drop the same elements, as one unsplit model would.
* ``local``: different on every TP rank. Masks for split tensors (attention heads,
  feed-forward shards, sequence-parallel slices) may come from it: ``dropout_rng:
  fast``, Megatron's choice, cheapest, but the masks then depend on the TP size.

With ``dropout_rng: exact`` (the default) a split tensor's mask is drawn from the
shared stream at the full, unsplit shape and each rank keeps its slice: training is
then bit-for-bit independent of the TP size (what ``megaformer parity`` checks and
what makes a resume at another TP size continue the same run), at the price of
drawing tp-times more random numbers for split tensors. The paper's model drops out
only replicated tensors (attention and activation dropout are 0), so without
sequence parallelism both modes cost the same.

Masks are drawn as 16 random bits per element (:func:`_random_bits16`), not with
``bernoulli_``: one 32-bit Mersenne Twister draw feeds two elements, and a
(32, 30, 512) mask costs ~0.7 ms instead of ~3.4 ms on a 2-core CPU (``bernoulli_``
was the largest cost after the matmuls). An element is dropped when its 16 bits,
read as a signed integer, fall below a threshold, so the drop probability is ``p``
rounded to a multiple of 2^-16 (0.1 -> 6554 / 65536 = 0.100006); kept elements are
scaled by the inverse of the rounded keep probability, so a mask's mean is exactly 1
in expectation.

The streams' states are saved in checkpoints and around activation recomputation.
"""

from __future__ import annotations

import hashlib

import torch

from megaformer.parallel.groups import TPGroup


def _mix(*parts: int) -> int:
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


_LEVELS = 1 << 16  # dropout probabilities are multiples of 2^-16


def _random_bits16(shape: list[int], generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """Uniform random int16 values of ``shape``, from 64-bit draws cut into four.

    ``random_(-2**63, None)`` is the one integer sampler that returns every bit of
    its draws (the other ranges cost a modulo or waste a bit); the values depend only
    on the generator's state and ``shape``, so a slice of a full-shape tensor is
    reproducible at any TP size.
    """
    numel = 1
    for size in shape:
        numel *= size
    words = torch.empty((numel + 3) // 4, dtype=torch.int64, device=device)
    words.random_(-(1 << 63), None, generator=generator)
    return words.view(torch.int16)[:numel].view(shape)


def _drop_levels(p: float) -> int:
    """p as a count of 2^-16 steps, at most 2^16 - 1 so that something is always kept."""
    return min(round(p * _LEVELS), _LEVELS - 1)


class DropoutRNG:
    """The shared and per-rank dropout streams of one model replica."""

    def __init__(
        self,
        seed: int,
        tp: TPGroup,
        dp_rank: int = 0,
        mode: str = "exact",
        device: torch.device | str = "cpu",
    ) -> None:
        if mode not in ("exact", "fast"):
            raise ValueError(f"dropout_rng must be 'exact' or 'fast', got {mode!r}")
        self.tp = tp
        self.mode = mode
        self.shared = torch.Generator(device=device).manual_seed(_mix(seed, dp_rank, "shared"))
        self.local = torch.Generator(device=device).manual_seed(_mix(seed, dp_rank, tp.rank, "local"))

    def keep_mask(self, x: torch.Tensor, p: float, split_dim: int | None) -> torch.Tensor:
        """A mask of kept elements for ``x``, already scaled by 1 / (1 - p) (p rounded to 2^-16).

        ``split_dim`` names the dimension along which ``x`` is this rank's slice of a
        tensor split over the TP group (None: ``x`` is replicated).
        """
        shape = list(x.shape)
        if split_dim is None or self.tp.size == 1:
            generator, narrow = self.shared, None
        elif self.mode == "fast":
            generator, narrow = self.local, None
        else:
            dim = split_dim % x.dim()
            shape[dim] *= self.tp.size
            generator, narrow = self.shared, (dim, self.tp.rank * x.shape[dim], x.shape[dim])
        bits = _random_bits16(shape, generator, x.device)
        if narrow is not None:
            bits = bits.narrow(*narrow)  # compare only this rank's slice
        drop = _drop_levels(p)
        # Signed 16-bit values are uniform on [-2^15, 2^15): an element is kept when its
        # value reaches drop - 2^15, which has probability 1 - drop / 2^16.
        mask = torch.ge(bits, drop - _LEVELS // 2, out=torch.empty(bits.shape, dtype=x.dtype, device=x.device))
        return mask.mul_(_LEVELS / (_LEVELS - drop))  # / the rounded keep probability

    def dropout(self, x: torch.Tensor, p: float, training: bool, split_dim: int | None = None) -> torch.Tensor:
        if not training or p == 0.0:
            return x
        return x * self.keep_mask(x, p, split_dim)

    def get_state(self) -> dict[str, torch.Tensor]:
        return {"shared": self.shared.get_state(), "local": self.local.get_state()}

    def set_state(self, state: dict[str, torch.Tensor]) -> None:
        self.shared.set_state(state["shared"])
        self.local.set_state(state["local"])


class Dropout(torch.nn.Module):
    """``torch.nn.Dropout`` drawing its masks from a :class:`DropoutRNG` stream."""

    def __init__(self, p: float, rng: DropoutRNG, split_dim: int | None = None) -> None:
        super().__init__()
        self.p = p
        self.rng = rng
        self.split_dim = split_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rng.dropout(x, self.p, self.training, self.split_dim)

    def extra_repr(self) -> str:
        return f"p={self.p}, split_dim={self.split_dim}"
