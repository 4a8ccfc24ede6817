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

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from megaformer.data.stream import Batch, TokenBatchStream
from megaformer.errors import ConfigError
from megaformer.parallel import DropoutRNG


@dataclass
class MicroBatch:
    stream: int  # which data stream (virtual DP rank) it came from
    batch: Batch


class DataFeed:
    """``per_stream_accumulation`` micro-batches from each of this rank's streams per optimizer step.

    ``rng`` is the model's :class:`DropoutRNG`; each stream keeps its own dropout
    state (:meth:`dropout_of` switches to it around a micro-batch).
    """

    def __init__(
        self,
        make_stream: Callable[[int, int], TokenBatchStream],  # (stream_index, stream_count) -> stream
        streams: int,
        dp_rank: int,
        dp_size: int,
        per_stream_accumulation: int,
        rng: DropoutRNG,
        rng_seed: int,
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
        self.dropout = {v: DropoutRNG.initial_state(rng_seed, rng.tp.rank, v) for v in self.mine}

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

    @contextmanager
    def dropout_of(self, stream: int) -> Iterator[None]:
        """Inside the block the model draws the dropout masks of ``stream`` (and advances its state)."""
        with self.rng.fork(self.dropout[stream]):
            yield

    def epoch(self) -> int:
        return min(s.epoch for s in self.sources.values())

    # ---- checkpoint state -------------------------------------------------------------------

    def close(self) -> None:
        """Stop the streams' loader workers now (their queues' semaphores are released with them).

        A rank ends with ``os._exit`` under the local launcher, which skips the collection
        that would otherwise stop the workers, and Python's resource tracker then warns of
        leaked semaphores.
        """
        for it in self.iterators.values():
            close = getattr(it, "close", None)
            if close is not None:
                close()  # a generator: its DataLoader iterator is released at once
        self.iterators.clear()
        gc.collect()

    def state_dict(self) -> dict:
        """Position and dropout state (seeds and counts: device-neutral) of each of this rank's streams.

        Positions and the TP-shared dropout stream are equal on the TP peers of a DP
        rank; the per-rank ("local") dropout stream differs between them.
        """
        return {
            "streams": self.streams,
            "positions": {v: self.sources[v].state_dict() for v in self.mine},
            "dropout": {v: self.dropout[v] for v in self.mine},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore exactly what :meth:`state_dict` gave (this rank, the same layout)."""
        self.load_replicas([state], state)

    def load_replicas(self, dp_ranks: list[dict], same_rank: dict | None) -> int:
        """Restore from the :meth:`state_dict` of every old DP rank, after a change of layout too.

        ``same_rank`` is the state of the old rank at this rank's (DP, TP) place, if one
        existed. With the same number of streams (any DP size that divides it) each
        stream continues exactly, the TP-shared dropout stream too (it does not depend on
        the TP size); the per-rank stream where the place existed. Otherwise every new
        stream re-plans the rest of the epoch from the old position (all old streams had
        consumed the same number of batches) and its dropout streams continue past the
        keys the old ones drew: started afresh, stream v would repeat the masks of the
        run's first steps. Returns the number of streams the checkpoint held.
        """
        positions: dict[int, dict] = {}
        dropout: dict[int, dict] = {}
        for s in dp_ranks:
            positions.update({int(k): v for k, v in s["positions"].items()})
            dropout.update({int(k): v for k, v in s["dropout"].items()})
        own = {int(k): v for k, v in (same_rank or {}).get("dropout", {}).items()}
        exact = len(positions) == self.streams
        for v in self.mine:
            self.sources[v].load_state_dict(positions[v] if exact else positions[min(positions)])
            if exact:
                self.dropout[v]["shared"] = list(dropout[v]["shared"])
                if v in own:
                    self.dropout[v]["local"] = list(own[v]["local"])
                else:  # a TP place the old layout lacked: its own seed, past the keys every TP rank drew
                    self.dropout[v]["local"][1] = dropout[v]["local"][1]
            else:
                for name in ("shared", "local"):
                    self.dropout[v][name][1] = max(d[name][1] for d in dropout.values())
        self.iterators.clear()
        return len(positions)
