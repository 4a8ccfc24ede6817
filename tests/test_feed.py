"""The data feed on its own: stream positions and dropout states survive a checkpoint and a DP change.

Streams are small in-memory stand-ins with the stream interface (iterate, epoch,
state_dict / load_state_dict); the real TokenBatchStream is tested in test_data_stream.py.
"""

import json

import torch

from megaformer.data.batching import stream_count
from megaformer.parallel import LOCAL, DropoutRNG
from megaformer.train.feed import DataFeed


class CountingStream:
    """Batches ``(index, n)`` for n = 0, 1, ...: enough to tell which batch comes next."""

    def __init__(self, index: int) -> None:
        self.index, self.position, self.epoch = index, 0, 0

    def __iter__(self):
        while True:
            self.position += 1
            yield (self.index, self.position - 1)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def _feed(streams: int, dp_rank: int, dp_size: int, per_stream: int = 2) -> DataFeed:
    rng = DropoutRNG(9, LOCAL)
    return DataFeed(lambda v, n: CountingStream(v), streams, dp_rank, dp_size, per_stream, rng, rng_seed=9)


def _step(feed: DataFeed) -> list[tuple]:
    """One step's batches, each with the first mask value its stream's dropout draws."""
    out = []
    for m in feed.next_step():
        with feed.dropout_of(m.stream):
            mask = feed.rng.keep_mask(torch.ones(16), 0.5, None)
        out.append((m.batch, mask.tolist()))
    return out


def _through_json(state: dict) -> dict:
    return json.loads(json.dumps(state))


def test_resume_continues_batches_and_masks():
    feed = _feed(2, 0, 1)
    _step(feed)
    state = _through_json(feed.state_dict())
    expected = [_step(feed) for _ in range(2)]
    resumed = _feed(2, 0, 1)
    resumed.load_state_dict(state)  # exactly what state_dict gave
    assert [_step(resumed) for _ in range(2)] == expected


def test_dp2_to_dp1_continues_both_streams_exactly():
    ranks = [_feed(2, r, 2) for r in range(2)]
    for f in ranks:
        _step(f)
    states = [_through_json(f.state_dict()) for f in ranks]
    # What the two ranks would have done next, step by step, merged in stream order.
    expected = [sorted(_step(ranks[0]) + _step(ranks[1]), key=lambda b: b[0][0]) for _ in range(2)]
    one = _feed(stream_count(2, 1), 0, 1)
    one.load_replicas(states, states[0])
    assert [_step(one) for _ in range(2)] == expected


def test_masks_of_a_stream_are_its_own():
    feed = _feed(2, 0, 1)
    first = _step(feed)
    for stream in (0, 1):
        rng = DropoutRNG(9, LOCAL, stream=stream)
        own = rng.keep_mask(torch.ones(16), 0.5, None).tolist()
        assert [mask for batch, mask in first if batch[0] == stream][0] == own


def test_other_stream_count_replans_from_the_old_position():
    old = _feed(2, 0, 1)
    for _ in range(3):
        _step(old)
    state = _through_json(old.state_dict())
    new = _feed(3, 0, 1)  # a DP size that does not divide the old streams
    new.load_replicas([state], None)
    assert all(s.position == 6 for s in new.sources.values())
    # the dropout streams go on past the 6 keys each old one drew (3 steps of 2 micro-batches): stream 0 does
    # not mask as at step 1
    assert [new.dropout[v]["shared"][1] for v in range(3)] == [6, 6, 6]
    first_masks = {batch[0]: mask for batch, mask in _step(_feed(2, 0, 1))}
    assert [mask for batch, mask in _step(new) if batch[0] == 0][0] != first_masks[0]


def test_a_tp_place_the_old_layout_lacked_continues_past_the_local_keys_drawn():
    """tp 2 -> 1 -> 2 with parallel.dropout_rng=fast: TP rank 1's place is back, its own state gone. Its local
    stream (its own seed) starts past the 7 keys each TP rank drew, not at 0 (masks of the run's first steps)."""
    state = _through_json(_feed(2, 0, 1).state_dict())
    for stream in state["dropout"].values():
        stream["local"][1] = 7
    new = _feed(2, 0, 1)
    new.load_replicas([state], None)  # the same streams; no old rank at this TP place
    assert [new.dropout[v]["local"][1] for v in (0, 1)] == [7, 7]
    assert [new.dropout[v]["shared"] for v in (0, 1)] == [state["dropout"][str(v)]["shared"] for v in (0, 1)]


def test_stream_count_keeps_the_runs_streams_when_dp_divides_them():
    assert stream_count(4, 2) == 4 and stream_count(4, 3) == 3 and stream_count(None, 2) == 2
