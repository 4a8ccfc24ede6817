"""Dropout randomness that is correct under tensor parallelism.

Two streams, both owned by one :class:`DropoutRNG`:

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
scaled by the inverse of the rounded keep probability. The scale multiplies in the
compute precision (a Python float, not a tensor of the activation dtype), so a bf16
activation is scaled by 1/0.9, not by bf16(1/0.9) = 1.109375, and a mask's mean is 1
in expectation in every precision.

**Device-neutral state.** Each stream is a counter: a 63-bit seed and the number of
masks drawn so far. Mask ``n`` comes from the device's own generator seeded with
``mix(seed, n)``, so the state is two integers per stream, the same on every device: a
checkpoint written on a CPU resumes on a GPU and the reverse. The masks themselves are
the device generator's (Mersenne Twister on a CPU, Philox on CUDA): a run continued on
another kind of device draws other, equally distributed masks from the same point,
and a run continued on the same kind of device draws exactly the masks it would have.
Reseeding costs ~2 us per mask, against ~0.7 ms for the mask itself.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

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


class _Stream:
    """A counter-based random stream: draw ``n`` uses a generator seeded with ``mix(seed, n)``.

    The generator lives on the device of the tensor being masked, created there at its
    first draw: never on an implicit default device.
    """

    def __init__(self, seed: int) -> None:
        self.seed, self.draws = seed, 0
        self.generator: torch.Generator | None = None

    def next_generator(self, device: torch.device) -> torch.Generator:
        if self.generator is None or self.generator.device != device:
            self.generator = torch.Generator(device=device)
        self.generator.manual_seed(_mix(self.seed, self.draws))
        self.draws += 1
        return self.generator


class DropoutRNG:
    """The shared and per-rank dropout streams of one model replica.

    ``stream``: which data stream (virtual DP rank) the streams belong to. Its state
    (:meth:`state_dict`) is plain integers: see the module docstring.
    """

    def __init__(
        self,
        seed: int,
        tp: TPGroup,
        stream: int = 0,
        mode: str = "exact",
    ) -> None:
        if mode not in ("exact", "fast"):
            raise ValueError(f"dropout_rng must be 'exact' or 'fast', got {mode!r}")
        self.tp = tp
        self.mode = mode
        state = self.initial_state(seed, tp.rank, stream)
        self.shared = _Stream(state["shared"][0])
        self.local = _Stream(state["local"][0])

    @staticmethod
    def initial_state(seed: int, tp_rank: int, stream: int) -> dict[str, list[int]]:
        """The state a fresh :class:`DropoutRNG` of this seed, TP rank and data stream starts from."""
        return {"shared": [_mix(seed, stream, "shared"), 0], "local": [_mix(seed, stream, tp_rank, "local"), 0]}

    def stream_of(self, split_dim: int | None) -> str:
        """``shared`` or ``local``: the stream a mask of a tensor split along ``split_dim`` (None: replicated) uses."""
        if split_dim is None or self.tp.size == 1 or self.mode == "exact":
            return "shared"
        return "local"

    def draws_of(self, p: float, split_dim: int | None) -> dict[str, int]:
        """Masks one dropout call of probability ``p`` draws from each stream in training (one, or none at p=0)."""
        counts = {"shared": 0, "local": 0}
        if p > 0.0:
            counts[self.stream_of(split_dim)] += 1
        return counts

    def keep_mask(self, x: torch.Tensor, p: float, split_dim: int | None) -> torch.Tensor:
        """A 0/1 mask (dtype of ``x``) of the elements kept with probability 1 - p (p rounded to 2^-16).

        ``split_dim`` names the dimension along which ``x`` is this rank's slice of a
        tensor split over the TP group (None: ``x`` is replicated).
        """
        shape = list(x.shape)
        narrow = None
        stream = getattr(self, self.stream_of(split_dim))
        if stream is self.shared and split_dim is not None and self.tp.size > 1:
            dim = split_dim % x.dim()
            shape[dim] *= self.tp.size
            narrow = (dim, self.tp.rank * x.shape[dim], x.shape[dim])
        bits = _random_bits16(shape, stream.next_generator(x.device), x.device)
        if narrow is not None:
            bits = bits.narrow(*narrow)  # compare only this rank's slice
        # Signed 16-bit values are uniform on [-2^15, 2^15): an element is kept when its
        # value reaches drop - 2^15, which has probability 1 - drop / 2^16.
        threshold = _drop_levels(p) - _LEVELS // 2
        return torch.ge(bits, threshold, out=torch.empty(bits.shape, dtype=x.dtype, device=x.device))

    def dropout(self, x: torch.Tensor, p: float, training: bool, split_dim: int | None = None) -> torch.Tensor:
        """x * mask / (1 - p): the scale is a Python float, applied in the compute precision."""
        if not training or p == 0.0:
            return x
        drop = _drop_levels(p)
        return x.mul(self.keep_mask(x, p, split_dim)).mul_(_LEVELS / (_LEVELS - drop))

    def state_dict(self) -> dict[str, list[int]]:
        """[seed, masks drawn] of each stream: plain integers, the same on every device."""
        return {"shared": [self.shared.seed, self.shared.draws], "local": [self.local.seed, self.local.draws]}

    def load_state_dict(self, state: dict[str, list[int]]) -> None:
        for name in ("shared", "local"):
            seed, draws = state[name]
            stream = getattr(self, name)
            stream.seed, stream.draws = int(seed), int(draws)

    @contextmanager
    def fork(self, state: dict[str, list[int]]) -> Iterator[dict[str, list[int]]]:
        """Draw from ``state`` inside the block; on leaving, ``state`` holds where the block left the streams.

        Megatron's ``rng_tracker.fork()``: the streams of a data stream, a recomputed
        layer, or a replayed forward are switched to visibly, and switched back.
        """
        outer = self.state_dict()
        self.load_state_dict(state)
        try:
            yield state
        finally:
            state.update(self.state_dict())
            self.load_state_dict(outer)


class Dropout(torch.nn.Module):
    """``torch.nn.Dropout`` drawing its masks from a :class:`DropoutRNG` stream."""

    def __init__(self, p: float, rng: DropoutRNG, split_dim: int | None = None) -> None:
        super().__init__()
        self.p = p
        self.rng = rng
        self.split_dim = split_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rng.dropout(x, self.p, self.training, self.split_dim)

    def mask_draws(self) -> dict[str, int]:
        """Masks one training forward draws from each stream (pipeline stages count their share)."""
        return self.rng.draws_of(self.p, self.split_dim)

    def extra_repr(self) -> str:
        return f"p={self.p}, split_dim={self.split_dim}"
