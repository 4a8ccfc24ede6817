"""How a parameter is split over the TP group, and the three things that follow from it.

Every parameter of a parallel layer is tagged with :func:`mark_sharded`: the dimension
it is split along and how many stacked blocks it holds (3 for a fused QKV weight, so
that each rank keeps whole heads of Q, K and V). Untagged parameters are replicated.
From the tag alone:

* initialisation builds the full tensor from the seed and the parameter's name, then
  keeps this rank's slice, so a TP=1 and a TP=4 model from one seed are one model;
* :func:`gather_full` assembles the TP=1 tensor (parity tests, export, resharding);
* :func:`shard_full` cuts a TP=1 tensor into this rank's slice (loading at any TP).
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.distributed as dist

from megaformer.parallel.groups import TPGroup


def mark_sharded(param: torch.Tensor, dim: int | None, partitions: int = 1, init: str = "xavier") -> None:
    """Tag ``param`` as split along ``dim`` (None: replicated) in ``partitions`` stacked blocks."""
    param.tp_dim = dim
    param.tp_partitions = partitions
    param.init_kind = init


def tp_dim(param: torch.Tensor) -> int | None:
    """The dimension ``param`` is split along over the TP group (None: replicated)."""
    return getattr(param, "tp_dim", None)


def tp_partitions(param: torch.Tensor) -> int:
    """How many stacked blocks ``param`` holds (3 for a fused QKV weight), each split on its own."""
    return getattr(param, "tp_partitions", 1)


def _blocks(full: torch.Tensor, dim: int, partitions: int) -> list[torch.Tensor]:
    return list(full.chunk(partitions, dim=dim))


# The one tensor with the padded vocabulary's rows (the tied embedding and output table): its padding
# depends on the TP size (parallel/layout.py::padded_vocab_size) wherever tp x 8 does not divide
# parallel.vocab_multiple (tp=3, or another multiple), so a merged checkpoint keeps the TP=1 padding
# and a split one the padding of the TP size it is split for (:func:`fit_vocab_rows`).
VOCAB_ROWS = "embed.weight"


def fit_vocab_rows(name: str, tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with ``rows`` rows if it is :data:`VOCAB_ROWS` (the padding cut, or added as zeros), else as it is.

    Padded rows never get probability and no token id reaches them, so their values (and
    Adam's moments there) carry nothing: cutting or adding them changes no result.
    """
    if name != VOCAB_ROWS or tensor.shape[0] == rows:
        return tensor
    if tensor.shape[0] > rows:
        return tensor[:rows].clone()
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])


def shard_full(full: torch.Tensor, dim: int | None, partitions: int, tp: TPGroup) -> torch.Tensor:
    """This rank's slice of a TP=1 tensor: the ``tp.rank``-th part of every stacked block."""
    if dim is None or tp.size == 1:
        return full
    parts = []
    for block in _blocks(full, dim, partitions):
        if block.shape[dim] % tp.size:
            raise ValueError(f"dimension {dim} of size {block.shape[dim]} does not split over {tp.size} ranks")
        step = block.shape[dim] // tp.size
        parts.append(block.narrow(dim, tp.rank * step, step))
    return torch.cat(parts, dim=dim).contiguous()


def merge_shards(pieces: list[torch.Tensor], dim: int | None, partitions: int) -> torch.Tensor:
    """The TP=1 tensor from every rank's slice, in rank order (the inverse of :func:`shard_full`)."""
    if dim is None or len(pieces) == 1:
        return pieces[0]
    per_rank_blocks = [_blocks(p, dim, partitions) for p in pieces]
    blocks = [torch.cat([rank_blocks[b] for rank_blocks in per_rank_blocks], dim=dim) for b in range(partitions)]
    return torch.cat(blocks, dim=dim)


def gather_full(local: torch.Tensor, dim: int | None, partitions: int, tp: TPGroup) -> torch.Tensor:
    """The TP=1 tensor, assembled from every rank's slice (a collective over ``tp``)."""
    if dim is None or tp.size == 1:
        return local.detach().clone()
    pieces = [torch.empty_like(local) for _ in range(tp.size)]
    dist.all_gather(pieces, local.detach().contiguous(), group=tp.group)
    return merge_shards(pieces, dim, partitions)


def full_shape(local: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    shape = list(local.shape)
    dim = tp_dim(local)
    if dim is not None:
        shape[dim] *= tp_size
    return tuple(shape)


# ---- initialisation -------------------------------------------------------------------------


def _xavier_uniform(t: torch.Tensor, g: torch.Generator) -> None:
    fan_out, fan_in = t.shape[0], t.shape[1]
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    t.uniform_(-bound, bound, generator=g)


def _init_full(kind: str, shape: tuple[int, ...], dim: int | None, partitions: int, g: torch.Generator) -> torch.Tensor:
    full = torch.empty(shape, dtype=torch.float32)
    if kind == "zeros":
        full.zero_()
    elif kind == "ones":
        full.fill_(1.0)
    elif kind == "xavier":
        # A fused weight is initialised block by block, as its separate matrices would be.
        for block in _blocks(full, dim if dim is not None else 0, partitions):
            _xavier_uniform(block, g)
    elif kind.startswith("normal:"):
        full.normal_(0.0, float(kind.split(":", 1)[1]), generator=g)
    else:
        raise ValueError(f"unknown init kind {kind!r}")
    return full


def init_parameters(model: torch.nn.Module, seed: int, tp: TPGroup) -> None:
    """Initialise every parameter from ``seed`` and its name, independently of the TP size.

    Each parameter is drawn at its full (TP=1) shape from a generator seeded by
    (seed, name) and this rank keeps its slice; a module may then fix up rows (the
    embedding zeroes padding) through a ``post_init()`` method.
    """
    for name, param in model.named_parameters():
        dim, partitions = tp_dim(param), tp_partitions(param)
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        full = _init_full(getattr(param, "init_kind", "xavier"), full_shape(param, tp.size), dim, partitions, g)
        with torch.no_grad():
            param.copy_(shard_full(full, dim, partitions, tp))
    for module in model.modules():
        if hasattr(module, "post_init"):
            module.post_init()


# ---- whole models ---------------------------------------------------------------------------


def gather_full_state(model: torch.nn.Module, tp: TPGroup) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` at its TP=1 shape (a collective: every TP rank calls it)."""
    return {name: gather_full(p, tp_dim(p), tp_partitions(p), tp).float() for name, p in model.named_parameters()}


def load_full_state(model: torch.nn.Module, state: dict[str, torch.Tensor], tp: TPGroup) -> None:
    """Copy this rank's slice of every TP=1 tensor in ``state`` into ``model``; names must match."""
    params = dict(model.named_parameters())
    missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or unexpected:
        raise ValueError(f"model state does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, p in params.items():
            full = fit_vocab_rows(name, state[name], p.shape[0] * tp.size)
            local = shard_full(full, tp_dim(p), tp_partitions(p), tp)
            if local.shape != p.shape:
                raise ValueError(
                    f"{name}: saved shape {tuple(state[name].shape)} gives {tuple(local.shape)} "
                    f"on this rank, the model has {tuple(p.shape)}"
                )
            p.copy_(local)
