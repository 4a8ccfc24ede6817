"""Dropout randomness that is correct under tensor parallelism, the same on every device, and compilable.

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

**Counter-based masks.** A mask is a pure function of a 64-bit key and the element's
position, as in Philox (what CUDA's dropout uses): the bits of element ``e`` are 16
bits of ``splitmix64(key + (e // 4 + 1) * golden)`` (SplitMix64, Steele et al. 2014; 64
bits feed four elements). There is no generator object, so the same key gives the
same mask on a CPU and a GPU, and the computation is plain integer tensor arithmetic
that ``torch.compile`` fuses into the dropout's kernel (``train.compile``): a Python
generator per mask would break every compiled graph at every dropout. An element is
dropped when its 16 bits, read as a signed integer, fall below a threshold, so the
drop probability is ``p`` rounded to a multiple of 2^-16 (0.1 -> 6554 / 65536 =
0.100006); kept elements are scaled by the inverse of the rounded keep probability.
The scale multiplies in the compute precision (a Python float, not a tensor of the
activation dtype), so a bf16 activation is scaled by 1/0.9, not by bf16(1/0.9) =
1.109375, and a mask's mean is 1 in expectation in every precision.

**Regions.** Each stream is a counter: a 63-bit seed and the number of keys drawn so
far, two integers, the same on every device. A layer draws its keys when it starts
(:meth:`DropoutRNG.region`, as many as :meth:`EncoderLayer.mask_draws` says): key
``n`` is ``mix(seed, n)``, and the layer's k-th mask of a stream uses the k-th key.
For a compiled layer the keys are made on its device by a fill (no host-to-device
copy, nothing waits for the GPU), so it reads them as tensor inputs and never sees a
counter that changes from step to step; an eager layer keeps them as Python integers
and adds them to counters kept per device, so an eager mask makes no tensor for its
key and no ``arange``. A dropout outside any layer (the embeddings) draws one key of
its own.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from megaformer.parallel import fused
from megaformer.parallel.groups import TPGroup


def _mix(*parts: int) -> int:
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_LEVELS = 1 << 16  # dropout probabilities are multiples of 2^-16
_GOLDEN = _signed64(0x9E3779B97F4A7C15)  # SplitMix64's increment and multipliers, as signed int64
_MIX1 = _signed64(0xBF58476D1CE4E5B9)
_MIX2 = _signed64(0x94D049BB133111EB)


def _splitmix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser of the int64 tensor ``z``, in place (logical shifts; products wrap mod 2^64)."""
    shifted = None  # the first shift allocates it, the others write into it
    for shift, multiplier in ((30, _MIX1), (27, _MIX2), (31, None)):
        shifted = torch.bitwise_right_shift(z, shift, out=shifted).bitwise_and_((1 << (64 - shift)) - 1)
        z.bitwise_xor_(shifted)
        if multiplier is not None:
            z.mul_(multiplier)
    return z


def _word_counters(words: int, device: torch.device) -> torch.Tensor:
    """(1, 2, ..., words) * golden: the counters of the first ``words`` 64-bit words before a key is added."""
    return torch.arange(1, words + 1, dtype=torch.int64, device=device).mul_(_GOLDEN)


def _random_bits16(shape: list[int], key: int | torch.Tensor, counters: torch.Tensor | None = None) -> torch.Tensor:
    """Uniform signed 16-bit values of ``shape``: element e gets lane e % 4 of word e // 4 of ``key``'s sequence.

    ``key`` is a 0-dim int64 tensor on the device the bits are made on (a compiled
    graph's input), or, eagerly, a Python integer with ``counters`` (at least
    :func:`_word_counters` of the words needed, on that device) saying where. The
    values depend only on the key and ``shape``, so a slice of a full-shape tensor is
    the same at any TP size, on any device, compiled or not. Eagerly, each 64-bit word
    is computed once and viewed as four int16 (little-endian: lane 0 is the low 16
    bits); in a compiled graph each element computes its word and shifts its lane out,
    which Inductor fuses into the consumer (it miscompiles a dtype view fused into one).
    """
    numel = 1
    for size in shape:
        numel *= size
    if torch.compiler.is_compiling():
        return bits_at_positions(numel, key).view(shape)
    words = (numel + 3) // 4
    if counters is None:
        counters = _word_counters(words, key.device)
    if counters.numel() != words:
        counters = counters[:words]
    bits = _splitmix64(torch.add(counters, key)).view(torch.int16)
    return (bits if bits.numel() == numel else bits[:numel]).view(shape)


def bits_at_positions(numel: int, key: torch.Tensor) -> torch.Tensor:
    """:func:`_random_bits16`'s values of ``numel`` elements, each computed from its own position (int64).

    The form a compiled kernel fuses into its consumer (``key`` a 0-dim int64 tensor on the
    device): every element computes its word and shifts its lane out.
    """
    position = torch.arange(numel, dtype=torch.int64, device=key.device)
    words = _splitmix64((position >> 2).add_(1).mul_(_GOLDEN).add_(key))
    lanes = (words >> ((position & 3) * 16)) & 0xFFFF
    return lanes - ((lanes >> 15) << 16)  # as signed 16-bit values


def _drop_levels(p: float) -> int:
    """p as a count of 2^-16 steps, at most 2^16 - 1 so that something is always kept."""
    return min(round(p * _LEVELS), _LEVELS - 1)


class _Stream:
    """A counter-based stream: key ``n`` is ``mix(seed, n)``."""

    def __init__(self, seed: int) -> None:
        self.seed, self.draws = seed, 0

    def next_keys(self, count: int, device: torch.device | None) -> list[int | torch.Tensor]:
        """The next ``count`` keys: 0-dim int64 tensors filled on ``device``, or Python integers if it is None."""
        keys = [_mix(self.seed, self.draws + i) for i in range(count)]
        self.draws += count
        if device is None:
            return keys
        return [torch.full((), key, dtype=torch.int64, device=device) for key in keys]


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
        self.keys: dict[str, list[int | torch.Tensor]] | None = None  # the open region's unused keys, per stream
        # (1, 2, ...) * golden per device, as long as the longest eager mask so far needed: each
        # eager mask then adds its key to a slice of it (one operator, not arange, mul and add)
        self._counters: dict[torch.device, torch.Tensor] = {}

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

    @contextmanager
    def region(self, draws: dict[str, int], device: torch.device | None) -> Iterator[None]:
        """Draw the keys of ``draws`` masks per stream now; the masks made inside the block use them in order.

        A layer runs inside one region. A compiled layer's keys reach it as 0-dim tensors
        filled on ``device``, graph inputs whose values change every step without a
        recompilation; an eager layer's (``device`` None) stay Python integers, and no
        tensor is made for them. The block must use exactly the keys it drew: a layer
        that made more or fewer masks than its ``mask_draws`` says would reuse or skip
        another layer's.
        """
        if self.keys is not None:
            raise RuntimeError("dropout regions do not nest")
        self.keys = {name: getattr(self, name).next_keys(n, device) for name, n in draws.items() if n}
        try:
            yield
            left = {name: len(keys) for name, keys in self.keys.items() if keys}
            if left:
                raise RuntimeError(f"a dropout region drew {draws} masks but left {left} unused")
        finally:
            self.keys = None

    def _next_key(self, stream: str, device: torch.device) -> int | torch.Tensor:
        if self.keys is None:  # a mask outside any region draws its own key
            return getattr(self, stream).next_keys(1, device if torch.compiler.is_compiling() else None)[0]
        keys = self.keys.get(stream)
        if not keys:
            raise RuntimeError(f"a dropout region made more {stream} masks than it drew keys for")
        return keys.pop(0)

    def _counters_for(self, shape: list[int], device: torch.device) -> torch.Tensor:
        words = (math.prod(shape) + 3) // 4
        counters = self._counters.get(device)
        if counters is None or counters.numel() < words:
            counters = self._counters[device] = _word_counters(words, device)
        return counters

    def keep_mask(self, x: torch.Tensor, p: float, split_dim: int | None) -> torch.Tensor:
        """A 0/1 mask (dtype of ``x``) of the elements kept with probability 1 - p (p rounded to 2^-16).

        ``split_dim`` names the dimension along which ``x`` is this rank's slice of a
        tensor split over the TP group (None: ``x`` is replicated).
        """
        shape = list(x.shape)
        narrow = None
        stream = self.stream_of(split_dim)
        if stream == "shared" and split_dim is not None and self.tp.size > 1:
            dim = split_dim % x.dim()
            shape[dim] *= self.tp.size
            narrow = (dim, self.tp.rank * x.shape[dim], x.shape[dim])
        counters = None if torch.compiler.is_compiling() else self._counters_for(shape, x.device)
        bits = _random_bits16(shape, self._next_key(stream, x.device), counters)
        if narrow is not None:
            bits = bits.narrow(*narrow)  # compare only this rank's slice
        # Signed 16-bit values are uniform on [-2^15, 2^15): an element is kept when its
        # value reaches drop - 2^15, which has probability 1 - drop / 2^16.
        threshold = _drop_levels(p) - _LEVELS // 2
        if torch.compiler.is_compiling():
            # 1 + the sign bit of bits - threshold: the same 0/1 without a boolean tensor, which
            # Inductor's CPU kernels store ~15x slower than a float one (the backward keeps the mask).
            return ((bits - threshold) >> 63).add_(1).to(x.dtype)
        # the comparison written straight into the mask's dtype: a boolean result converted after
        # (.to) costs 6x the comparison on a CPU (0.73 ms against 0.11 for 1536 x 256 elements)
        return torch.ge(bits, threshold, out=torch.empty(bits.shape, dtype=x.dtype, device=x.device))

    def dropout(self, x: torch.Tensor, p: float, training: bool, split_dim: int | None = None) -> torch.Tensor:
        """x * mask / (1 - p): the scale is a Python float, applied in the compute precision."""
        if not training or p == 0.0:
            return x
        drop = _drop_levels(p)
        scale = _LEVELS / (_LEVELS - drop)
        if self._one_kernel(x, split_dim):
            key = self._next_key(self.stream_of(split_dim), x.device)
            return fused.dropout(x, key, drop - _LEVELS // 2, scale)
        return x.mul(self.keep_mask(x, p, split_dim)).mul_(scale)

    def _one_kernel(self, x: torch.Tensor, split_dim: int | None) -> bool:
        """Whether the mask and its use are one operator (:func:`megaformer.parallel.fused.dropout`): off the
        CPU (whose eager form keeps the mask for the backward), outside a compiled graph (which fuses the
        mask itself), for a mask of the tensor itself (not this rank's slice of a wider one's), with a key that is
        an integer (a compiled layer's keys are tensors, also where Dynamo runs that layer eagerly)."""
        if x.device.type == "cpu" or torch.compiler.is_compiling() or not fused.enabled():
            return False
        stream = self.stream_of(split_dim)
        waiting = self.keys.get(stream) if self.keys is not None else None
        if waiting and torch.is_tensor(waiting[0]):
            return False
        return not (stream == "shared" and split_dim is not None and self.tp.size > 1)

    def state_dict(self) -> dict[str, list[int]]:
        """[seed, keys drawn] of each stream: plain integers, the same on every device."""
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
