"""The micro-batches of each optimizer step, with a data order that survives a change of DP size.

A run's data is planned for ``streams`` data-parallel *streams*, fixed when the run
starts (its first DP size) and kept in every checkpoint. Each rank reads
``streams / dp`` of them, one after the other within a step, and each stream has its
own dropout RNG state. Resuming with a DP size that divides ``streams`` therefore
replays exactly the batches, in the same optimizer steps, and the same dropout masks
as the original layout would have: DP 2 -> 1 continues the run, not a similar run.
A DP size that does not divide it re-plans the rest of the epoch (every sample still
seen once, see :mod:`megaformer.data.stream`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megaformer.data.stream import Batch, TokenBatchStream
from megaformer.errors import ConfigError
from megaformer.parallel import DropoutRNG


@dataclass
class MicroBatch:
    stream: int  # which data stream (virtual DP rank) it came from
    batch: Batch


class DataFeed:
    """``accumulation`` micro-batches from each of this rank's streams per optimizer step."""

    def __init__(
        self,
        make_stream,  # (stream_index, stream_count) -> TokenBatchStream
        streams: int,
        dp_rank: int,
        dp_size: int,
        per_stream_accumulation: int,
        rng: DropoutRNG,
        rng_seed: int,
        rng_mode: str,
    ) -> None:
        if streams % dp_size:
            raise ConfigError(f"data streams={streams} is not a multiple of the DP size {dp_size}")
        self.streams = streams
        self.mine = list(range(dp_rank * streams // dp_size, (dp_rank + 1) * streams // dp_size))
        self.per_stream_accumulation = per_stream_accumulation
        self.sources: dict[int, TokenBatchStream] = {v: make_stream(v, streams) for v in self.mine}
        self.iterators: dict[int, Iterator[Batch]] = {}
        self.rng = rng
        # One dropout state per stream, as the rank that owned it would have had.
        self.rng_states = {v: DropoutRNG(rng_seed, rng.tp, v, rng_mode).get_state() for v in self.mine}

    @property
    def accumulation(self) -> int:
        """Micro-batches this rank runs per optimizer step."""
        return self.per_stream_accumulation * len(self.mine)

    def next_step(self) -> list[MicroBatch]:
        out = []
        for v in self.mine:
            it = self.iterators.get(v)
            if it is None:
                it = self.iterators[v] = iter(self.sources[v])
            out.extend(MicroBatch(v, next(it)) for _ in range(self.per_stream_accumulation))
        return out

    def use_rng_of(self, stream: int) -> None:
        """Switch the model's dropout streams to those of ``stream`` (before its micro-batch)."""
        self.rng.set_state(self.rng_states[stream])

    def save_rng_of(self, stream: int) -> None:
        self.rng_states[stream] = self.rng.get_state()

    def epoch(self) -> int:
        return min(s.epoch for s in self.sources.values())

    # ---- checkpoint state -------------------------------------------------------------------

    def state(self) -> dict:
        """The position and the TP-shared dropout stream of each of this rank's data streams.

        Identical on the TP peers of a DP rank; kept in the checkpoint's metadata.
        """
        return {
            "streams": self.streams,
            "positions": {v: self.sources[v].state_dict() for v in self.mine},
            "rng": {v: self.rng_states[v]["shared"].tolist() for v in self.mine},
        }

    def local_rng_state(self) -> dict[int, torch.Tensor]:
        """The per-TP-rank dropout stream of each data stream (differs between TP peers)."""
        return {v: self.rng_states[v]["local"].clone() for v in self.mine}

    def load(self, states: list[dict], local_rng: dict[int, torch.Tensor] | None = None) -> None:
        """Restore from a checkpoint: ``states`` of every DP rank, ``local_rng`` of this rank if its place existed.

        With the same number of streams (any DP size that divides it) each stream
        continues exactly; the TP-shared dropout stream too (it does not depend on the
        TP size). Otherwise every new stream re-plans the rest of the epoch from the old
        position (all old streams had consumed the same number of batches) and starts
        fresh dropout streams.
        """
        positions: dict[int, dict] = {}
        shared: dict[int, list] = {}
        for s in states:
            positions.update({int(k): v for k, v in s["positions"].items()})
            shared.update({int(k): v for k, v in s["rng"].items()})
        exact = len(positions) == self.streams
        for v in self.mine:
            self.sources[v].load_state_dict(positions[v] if exact else positions[min(positions)])
            if exact:
                self.rng_states[v]["shared"] = torch.tensor(shared[v], dtype=torch.uint8)
                if local_rng is not None and v in local_rng:
                    self.rng_states[v]["local"] = local_rng[v].clone()
        self.iterators.clear()


def stream_count(saved_streams: int | None, dp: int) -> int:
    """Streams of a run: kept from its checkpoint when the DP size divides them, else the DP size."""
    if saved_streams and saved_streams % dp == 0:
        return saved_streams
    return dp
