"""``meta.json``'s schema: the one place that knows where a checkpoint keeps what, in writing and in reading.

Torch-free (json and pathlib): the process that launches ``megaformer train`` reads a checkpoint's
data streams and SLURM job through it before any rank imports torch. ::

    {<what the trainer adds: tokens, vocab_size, config, reason, slurm_job, time>,
     "format", "step",
     "layout": {tp, dp, pp, world[, stages]},      the model files' layout; stages: layers per stage
     "rank_layout": {...},                         the layout of the rank files and replicas (kept by reshard)
     "run": {name: state},                         states equal on every rank (engine counters, trainer)
     "replicas": [{name: state}, ...],             every rank's small states, in rank order (the data feed)
     "files": {name: {bytes, sha256}}}

Each state is filed under the name its component was registered with
(:class:`megaformer.train.checkpointer.Checkpointer`); the data feed's is :data:`FEED`.
"""

from __future__ import annotations

import json
from pathlib import Path

from megaformer.checkpoint.format import CHECKPOINT_FORMAT
from megaformer.errors import CheckpointError

FEED = "feed"  # the data feed's replica state, which holds the run's data streams


def compose(extra: dict, step: int, layout: dict, run: dict[str, dict], replicas: list[dict]) -> dict:
    """meta.json, without its ``files`` (added last, when every file is written), in its order of keys.

    ``layout``: the sizes (tp, dp, pp, world), and ``stages`` for a pipeline; ``replicas``: every rank's.
    """
    return {
        **extra,
        "format": CHECKPOINT_FORMAT,
        "step": step,
        "layout": layout,
        "rank_layout": layout,
        "run": run,
        "replicas": replicas,
    }


def read_meta(step_dir: Path) -> dict:
    """A step directory's meta.json as it is, unchecked (:func:`megaformer.checkpoint.format.check_complete` checks
    it); raises OSError or ValueError where it is missing or not JSON."""
    meta = json.loads((Path(step_dir) / "meta.json").read_text())
    if not isinstance(meta, dict):
        raise ValueError(f"{step_dir / 'meta.json'}: not a JSON object")
    return meta


def step_of(meta: dict) -> int:
    return meta["step"]


def layout_of(meta: dict) -> dict:
    """The layout of the model files: tp, dp, pp (absent before pipelines: 1) and the stages' layers."""
    return meta["layout"]


def stages_of(meta: dict) -> list[int] | None:
    """Layers per pipeline stage of the run that wrote ``meta``; None without a pipeline."""
    return meta["layout"].get("stages")


def config_of(meta: dict) -> dict | None:
    """The config the checkpoint was trained with, as a dict (None where meta.json holds none)."""
    return meta.get("config")


def slurm_job_of(meta: dict) -> str | None:
    """The SLURM job that saved the checkpoint (None outside SLURM, or before it was recorded)."""
    return meta.get("slurm_job")


def saved_streams(meta: dict) -> int | None:
    """The data streams of the run that wrote ``meta`` (its first replica's feed); None where meta.json does not
    say (edited by hand, or not a training checkpoint)."""
    try:
        streams = meta["replicas"][0][FEED]["streams"]
    except (LookupError, TypeError):
        return None
    return streams if isinstance(streams, int) and not isinstance(streams, bool) and streams > 0 else None


def require_streams(step_dir: Path, meta: dict) -> int:
    """:func:`saved_streams` of the checkpoint a run resumes: one that does not say is refused in one line."""
    streams = saved_streams(meta)
    if streams is None:
        raise CheckpointError(
            f"{step_dir / 'meta.json'}: replicas[0].{FEED}.streams is not a count of data streams (edited?); "
            f"resume from another checkpoint"
        )
    return streams


def run_state(meta: dict, name: str) -> dict:
    """The state equal on every rank registered as ``name`` (raises KeyError where meta.json lacks it)."""
    return meta["run"][name]


def replica_states(meta: dict, name: str) -> list[dict]:
    """The replica state ``name`` of the first TP rank of every old DP rank (of the first stage: the stages of a
    replica read the same data and keep the same dropout positions)."""
    rl = meta["rank_layout"]
    return [meta["replicas"][d * rl["tp"]][name] for d in range(rl["dp"])]


def replica_state_at(meta: dict, name: str, dp_rank: int, tp_rank: int) -> dict | None:
    """The replica state ``name`` of the old rank at (``dp_rank``, ``tp_rank``) of the first stage, if it existed."""
    rl = meta["rank_layout"]
    if dp_rank < rl["dp"] and tp_rank < rl["tp"]:
        return meta["replicas"][dp_rank * rl["tp"] + tp_rank][name]
    return None
