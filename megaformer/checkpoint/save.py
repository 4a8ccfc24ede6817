"""Writing one checkpoint: every rank its files into a hidden folder, rank 0 ``meta.json`` last, then the rename."""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megaformer.checkpoint.files import write_shard
from megaformer.checkpoint.format import (
    model_file_name,
    prune,
    rank_file_name,
    step_dir_name,
    write_best,
)
from megaformer.checkpoint.meta import compose
from megaformer.errors import CheckpointError
from megaformer.files import PATH_ERRNOS, atomic_torch_save, atomic_write_text, path_refusal, sha256_of

# ---- saving -------------------------------------------------------------------------------------


@dataclass
class CheckpointState:
    """What one rank hands to :func:`save_checkpoint`, by where it lives.

    ``shard``: tensors at this rank's TP shape, complete over DP (the engine's);
    ``run``: states equal on every rank (engine counters, trainer), written once;
    ``replica``: states that differ between ranks but are small (the data feed), every
    rank's kept in meta.json; ``rank``: this rank's own bulky state (the torch RNG).
    Each place maps a component's name to its state (``shard``: the one sharded component's tensors).
    """

    shard: dict[str, dict[str, torch.Tensor]]
    run: dict[str, dict]
    replica: dict[str, dict]
    rank: dict[str, object]


def _barrier(ctx) -> None:
    if dist.is_initialized():
        dist.barrier(group=ctx.world_group)


def file_entries(folder: Path) -> dict[str, dict]:
    return {p.name: {"bytes": p.stat().st_size, "sha256": sha256_of(p)} for p in sorted(folder.iterdir())}


def _finite_or_refuse(shard: dict[str, dict[str, torch.Tensor]], step: int) -> None:
    bad = [n for n, t in shard["param"].items() if not bool(torch.isfinite(t).all())]
    if bad:
        raise CheckpointError(
            f"step {step}: {len(bad)} parameters hold inf or NaN (first: {bad[0]}): not saving a broken model"
        )


def save_checkpoint(
    root: Path, step: int, ctx, state: CheckpointState, meta: dict, keep_last: int, tokenizer: Path | None = None
) -> Path:
    """Write one checkpoint; every rank calls this (it holds barriers over ``ctx``'s world).

    ``state.shard`` is written by the first DP rank of each TP rank, ``state.rank`` by
    every rank; ``state.replica`` of every rank is gathered into ``meta.json``, which
    rank 0 writes last (with every file's sha256) before the directory is renamed into
    place and ``latest`` replaced (and ``best``, when ``meta["best"]``), then older steps pruned.
    Refuses, on every rank, a model that is not finite.
    """
    _finite_or_refuse(state.shard, step)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = root / f".{step_dir_name(step)}.tmp"
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(ctx)
    with _writing(tmp):
        if ctx.dp_rank == 0:
            name = model_file_name(ctx.tp.rank, ctx.layout.tp, ctx.pp_rank, ctx.pp_size)
            write_shard(state.shard, tmp / name)  # the moments apart: decoding and export never open them
        atomic_torch_save(state.rank, tmp / rank_file_name(ctx.rank))
    replicas = [None] * ctx.layout.world_size
    if dist.is_initialized():
        dist.all_gather_object(replicas, state.replica, group=ctx.world_group)
    else:
        replicas = [state.replica]
    _barrier(ctx)  # every shard is on disk
    if ctx.is_main:
        extra = dict(meta)
        stages = extra.pop("stages", None)
        best = extra.pop("best", False)  # name this step in root/best (kept by prune)
        layout = {"tp": ctx.layout.tp, "dp": ctx.layout.dp, "pp": ctx.pp_size, "world": ctx.layout.world_size}
        if stages is not None:
            layout["stages"] = stages
        with _writing(tmp):
            _publish(tmp, final, compose(extra, step, layout, state.run, replicas), tokenizer)
            if best:
                write_best(root, final)
            prune(root, keep_last)
    _barrier(ctx)
    return final


@contextmanager
def _writing(tmp: Path) -> Iterator[None]:
    """Turn a failed write (a full disk, a quota, a vanished folder) into one line; the unfinished save is removed.

    torch reports a full disk as a RuntimeError from its zip writer ("unexpected pos").
    The checkpoints saved before are untouched: a save only becomes visible by its rename.
    """
    try:
        yield
    except (OSError, RuntimeError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError) and err.errno in PATH_ERRNOS and err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise CheckpointError(  # the true cause: a full disk is not the only one
                f"{path_refusal(err.filename or tmp.parent, err)}: the checkpoint was not written; the earlier "
                f"checkpoints are intact"
            ) from None
        reason = getattr(err, "strerror", None) or str(err).splitlines()[0]
        raise CheckpointError(
            f"{tmp.parent}: cannot write the checkpoint ({reason}): free space there or point --run-dir elsewhere; "
            f"the earlier checkpoints are intact"
        ) from None


def _publish(tmp: Path, final: Path, meta: dict, tokenizer: Path | None) -> None:
    """The tokenizer, then meta.json with every file's sha256 (last), the rename into place, ``latest``."""
    if tokenizer is not None and Path(tokenizer).is_file():
        shutil.copyfile(tokenizer, tmp / "tokenizer.model")
    atomic_write_text(tmp / "meta.json", json.dumps({**meta, "files": file_entries(tmp)}, indent=1))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write_text(final.parent / "latest", final.name + "\n")
