"""The batch stream: exactly once per epoch across DP ranks, TP peers identical, resume, errors."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing import resource_tracker
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from megaformer import cli
from megaformer.data.stream import (
    Batch,
    PlanSettings,
    PreparedSplit,
    TokenBatchStream,
    open_prepared,
    padding_waste,
    plan_epoch,
    scan_shards,
)
from megaformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from megaformer.errors import DataError

N_TRAIN = 3000
# Small batches and windows so that an epoch has many batches, windows and shard runs.
ROOT = Path(__file__).resolve().parents[1]
OPTIONS = dict(max_tokens=256, sort_buffer=600, shuffle_buffer=100, seed=7)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("stream") / "data"
    assert cli.main(["prepare", "--synthetic", str(N_TRAIN), "--out", str(out), "--shard-size", "400", "--quiet"]) == 0
    return out


@pytest.fixture(scope="module")
def one_shard(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("stream") / "one"
    assert cli.main(["prepare", "--synthetic", "500", "--out", str(out), "--vocab-size", "600", "--quiet"]) == 0
    return out


def take(stream: TokenBatchStream, count: int) -> list[Batch]:
    it = iter(stream)
    return [next(it) for _ in range(count)]


def epoch_batches(path: Path, epoch: int, **kw: object) -> int:
    return TokenBatchStream(path, "train", dp_rank=0, epoch=epoch, **kw).batches_per_epoch()


def assert_same(a: Batch, b: Batch) -> None:
    for name in ("src", "tgt_in", "tgt_out", "ids"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.src_tokens, a.tgt_tokens) == (b.src_tokens, b.tgt_tokens)


def check_batch(batch: Batch, max_tokens: int) -> None:
    rows = torch.arange(len(batch))
    src_len = (batch.src != PAD_ID).sum(1)
    tgt_len = (batch.tgt_out != PAD_ID).sum(1)
    assert torch.all(batch.src[rows, src_len - 1] == EOS_ID)
    assert torch.all(batch.tgt_in[:, 0] == BOS_ID)
    assert torch.all(batch.tgt_out[rows, tgt_len - 1] == EOS_ID)
    # tgt_out is tgt_in shifted left by one.
    assert torch.equal(
        batch.tgt_in[:, 1:][batch.tgt_out[:, :-1] != EOS_ID], batch.tgt_out[:, :-1][batch.tgt_out[:, :-1] != EOS_ID]
    )
    assert batch.src_tokens == int(src_len.sum()) and batch.tgt_tokens == int(tgt_len.sum())
    assert batch.src.numel() <= max_tokens and batch.tgt_out.numel() <= max_tokens
    assert batch.src.dtype == batch.tgt_in.dtype == torch.long


def test_world_of_four_exactly_once_and_tp_peers_identical(prepared: Path) -> None:
    """TP=2 x DP=2 with 2 real loader workers, 2 epochs."""
    counts = [epoch_batches(prepared, e, dp_size=2, **OPTIONS) for e in (0, 1)]
    streams = {
        (tp, dp): TokenBatchStream(prepared, "train", dp_rank=dp, dp_size=2, num_workers=2, **OPTIONS)
        for tp in (0, 1)
        for dp in (0, 1)
    }
    got = {rank: take(stream, sum(counts)) for rank, stream in streams.items()}
    for dp in (0, 1):
        for a, b in zip(got[0, dp], got[1, dp]):
            assert_same(a, b)
    seen_by_epoch = []
    for epoch, (first, count) in enumerate(zip((0, counts[0]), counts)):
        ids = torch.cat([b.ids for dp in (0, 1) for b in got[0, dp][first : first + count]])
        assert torch.equal(ids.sort().values, torch.arange(N_TRAIN)), f"epoch {epoch} is not exactly once"
        seen_by_epoch.append({tuple(b.ids.tolist()) for b in got[0, 0][first : first + count]})
    assert seen_by_epoch[0] != seen_by_epoch[1]  # each epoch draws new batches
    for batch in got[0, 0] + got[0, 1]:
        check_batch(batch, OPTIONS["max_tokens"])
    assert all(s.epoch == 2 and s.position == 0 for s in streams.values())


def test_fewer_shards_than_ranks_times_workers(one_shard: Path) -> None:
    assert len(open_prepared(one_shard).urls) == 1
    streams = [TokenBatchStream(one_shard, "train", dp_rank=r, dp_size=4, num_workers=2, **OPTIONS) for r in range(4)]
    count = streams[0].batches_per_epoch()
    ids = torch.cat([b.ids for s in streams for b in take(s, count)])
    assert torch.equal(ids.sort().values, torch.arange(500))


def test_batches_do_not_depend_on_worker_count(prepared: Path) -> None:
    """Read in this process, or read ahead by persistent workers: the same batches, across two epoch boundaries."""
    count = epoch_batches(prepared, 0, dp_size=1, **OPTIONS) + epoch_batches(prepared, 1, dp_size=1, **OPTIONS) + 5
    runs = [
        take(TokenBatchStream(prepared, "train", dp_rank=0, dp_size=1, num_workers=w, **OPTIONS), count)
        for w in (0, 1, 2)
    ]
    for batches in runs[1:]:
        for a, b in zip(runs[0], batches, strict=True):
            assert_same(a, b)


def test_workers_persist_across_epochs_and_stop_with_the_iterator(prepared: Path) -> None:
    """One set of loader processes reads every epoch; closing the iterator stops them and the read-ahead thread."""
    me = psutil.Process()
    # Spawned workers start Python's resource tracker (once per process; it stays): not a worker.
    resource_tracker.ensure_running()
    before = {p.pid for p in me.children(recursive=True)}
    stream = TokenBatchStream(prepared, "train", dp_rank=0, dp_size=2, num_workers=2, **OPTIONS)
    per_epoch = stream.batches_per_epoch()
    batches = iter(stream)
    seen = []
    for i in range(2 * per_epoch + 3):
        next(batches)
        if i in (1, per_epoch + 1, 2 * per_epoch + 1):
            seen.append({p.pid for p in me.children(recursive=True)} - before)
    assert stream.epoch == 2 and stream.position == 3
    assert len(seen[0]) >= 2 and seen[0] == seen[1] == seen[2], seen
    batches.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and ({p.pid for p in me.children(recursive=True)} & seen[0]):
        time.sleep(0.1)
    assert not {p.pid for p in me.children(recursive=True) if p.is_running()} & seen[0]
    assert not [t for t in threading.enumerate() if t.name == "megaformer-read"]


# A rank that reads with two workers, names them and waits to be killed.
_RANK_WITH_WORKERS = """
import sys, time, psutil
from multiprocessing import resource_tracker
from megaformer.data.stream import TokenBatchStream
me = psutil.Process()
resource_tracker.ensure_running()  # a child of its own, not a worker
stream = TokenBatchStream(sys.argv[1], "train", dp_rank=0, dp_size=1, num_workers=2, repeat=True, max_tokens=256)
batches, workers = iter(stream), set()
while len(workers) < 2:  # the read-ahead starts them: forked, they run this process's command line
    next(batches)
    workers = {p.pid for p in me.children() if p.cmdline() == me.cmdline()}
print(*workers, flush=True)
time.sleep(300)
"""


def test_workers_of_a_killed_rank_exit(prepared: Path) -> None:
    """kill -9 of a rank (or the OOM killer): its loader workers exit instead of living on as orphans."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rank = subprocess.Popen(
        [sys.executable, "-c", _RANK_WITH_WORKERS, str(prepared)], stdout=subprocess.PIPE, text=True, env=env
    )
    timer = threading.Timer(120, rank.kill)  # a rank that never names its workers does not hang the suite
    timer.start()
    try:
        workers = [psutil.Process(int(pid)) for pid in rank.stdout.readline().split()]  # each knows its start time
    finally:
        timer.cancel()
        rank.kill()
        rank.wait()

    def alive() -> list[psutil.Process]:
        running = []
        for worker in workers:
            with contextlib.suppress(psutil.NoSuchProcess):  # reaped between the two questions
                if worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE:  # this container's init reaps none
                    running.append(worker)
        return running

    deadline = time.monotonic() + 20
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = alive()
    for worker in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            worker.kill()  # psutil checks the start time: never another process that took the pid
    assert len(workers) == 2 and not left, f"workers {workers}: {left} outlived their rank"


def test_a_split_smaller_than_a_window_is_read_at_most_two_epochs_and_a_shuffle_ahead(prepared, monkeypatch):
    """The read-ahead holds two windows and a shuffle's reach, an epoch where that is less: with the
    default windows (100,000 samples) a 3,000-pair split was decoded ~70 epochs ahead, the workers busy
    throughout (they decoded ~1 CPU second a second beside a small SLURM job)."""
    from megaformer.data import readahead

    most, pull = [0], readahead.SampleStore.pull

    def counted(store):
        most[0] = max(most[0], store.held)
        return pull(store)

    monkeypatch.setattr(readahead.SampleStore, "pull", counted)
    stream = TokenBatchStream(prepared, "train", dp_rank=0, dp_size=1, num_workers=1, max_tokens=256, seed=7)
    batches = iter(stream)
    next(batches)
    # The read-ahead thread pulls all it may while the consumer waits: past the epoch (however long a loaded
    # machine takes to decode it), then 2 s more, in which the unbounded read-ahead went on by thousands.
    deadline = time.monotonic() + 120
    while most[0] <= N_TRAIN and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(2)
    next(batches)
    batches.close()
    assert N_TRAIN < most[0] <= 3 * N_TRAIN + 512, most  # a chunk (512 samples) past the limit at most


def test_batches_hold_the_prepared_text(prepared: Path) -> None:
    """Valid samples decode back to their (normalised) line: ids are line numbers."""
    tokenizer = Tokenizer(prepared / "spm.model")
    src_lines = (prepared / "valid.xx").read_text().splitlines()
    tgt_lines = (prepared / "valid.yy").read_text().splitlines()
    stream = TokenBatchStream(prepared, "valid", dp_rank=0, dp_size=1, max_tokens=512, shuffle=False, repeat=False)
    seen = []
    for batch in stream:
        for row, line in enumerate(batch.ids.tolist()):
            assert tokenizer.decode(batch.src[row].tolist()) == src_lines[line]
            assert tokenizer.decode(batch.tgt_out[row].tolist()) == tgt_lines[line]
            seen.append(line)
    assert sorted(seen) == list(range(len(src_lines)))
    assert list(stream) != []  # repeat=False: the next iter() runs the next epoch


def fingerprint(batch: Batch) -> list:
    """Sample ids and a digest of the padded tensors: equal fingerprints, equal batches."""
    data = batch.src.numpy().tobytes() + batch.tgt_in.numpy().tobytes() + batch.tgt_out.numpy().tobytes()
    return [batch.ids.tolist(), hashlib.sha256(data).hexdigest()]


RESUME_SCRIPT = textwrap.dedent("""
    import json, sys
    from megaformer.data.stream import TokenBatchStream
    path, workers, count, state, options, tests = sys.argv[1:]
    sys.path.insert(0, tests)
    from test_data_stream import fingerprint
    stream = TokenBatchStream(path, "train", dp_rank=1, num_workers=int(workers), **json.loads(options))
    stream.load_state_dict(json.loads(state))
    batches = iter(stream)
    print(json.dumps([fingerprint(next(batches)) for _ in range(int(count))]))
""")


@pytest.mark.parametrize("workers_after", [0, 1])
def test_resume_in_a_fresh_process_continues_the_same_batches(prepared: Path, workers_after: int) -> None:
    options = dict(dp_size=2, **OPTIONS)
    per_epoch = epoch_batches(prepared, 0, **options)
    stop, more = per_epoch - 4, 10  # the continuation crosses into epoch 1
    reference = [
        fingerprint(b)
        for b in take(TokenBatchStream(prepared, "train", dp_rank=1, num_workers=2, **options), stop + more)
    ]
    first = TokenBatchStream(prepared, "train", dp_rank=1, num_workers=2, **options)
    assert [fingerprint(b) for b in take(first, stop)] == reference[:stop]
    state = first.state_dict()
    assert state["epoch"] == 0 and state["batches"] == stop
    assert first.batches_per_epoch() == per_epoch
    argv = [
        str(prepared),
        str(workers_after),
        str(more),
        json.dumps(state),
        json.dumps(options),
        str(Path(__file__).parent),
    ]
    result = subprocess.run([sys.executable, "-c", RESUME_SCRIPT, *argv], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == reference[stop:]


def test_resume_with_another_dp_size_keeps_the_epoch_exactly_once(prepared: Path) -> None:
    old = [TokenBatchStream(prepared, "train", dp_rank=r, dp_size=2, **OPTIONS) for r in (0, 1)]
    consumed = [b.ids for s in old for b in take(s, 5)]
    state = old[0].state_dict()
    assert state == old[1].state_dict()  # the state does not depend on the rank
    new = [TokenBatchStream(prepared, "train", dp_rank=r, dp_size=3, **OPTIONS) for r in range(3)]
    for stream in new:
        stream.load_state_dict(state)
    rest = [b.ids for s in new for b in take(s, s.batches_per_epoch())]
    assert torch.equal(torch.cat(consumed + rest).sort().values, torch.arange(N_TRAIN))
    again = TokenBatchStream(prepared, "train", dp_rank=2, dp_size=3, **OPTIONS)
    again.load_state_dict(new[2].state_dict())  # a state taken after the change resumes too
    assert again.position == new[2].position and again.batches_per_epoch() == new[2].batches_per_epoch()
    assert all(s.epoch == 1 and s.position == 0 for s in new)
    next_epoch = [b.ids for s in new for b in take(s, s.batches_per_epoch())]
    assert torch.equal(torch.cat(next_epoch).sort().values, torch.arange(N_TRAIN))


def test_equal_batch_counts_when_ranks_hold_different_lengths() -> None:
    # Rank 0's share is all long sentences, rank 1's all short ones: unequal counts before balancing.
    lengths = np.array([[40, 40]] * 300 + [[3, 4]] * 300)
    data = PreparedSplit("train", ("unused",), (600,), lengths)
    settings = PlanSettings(
        dp_size=2, max_tokens=400, max_len=256, shuffle_buffer=0, sort_buffer=1000, seed=1, shuffle=False
    )
    plans = plan_epoch(data, settings, epoch=0)
    # 9 long pairs (41 tokens with eos) fit in 400 tokens: 34 batches; the short side has 4, split to 34.
    assert len(plans[0].batches) == len(plans[1].batches) == 34
    ids = np.sort(np.concatenate([b for p in plans for b in p.batches]))
    assert np.array_equal(ids, np.arange(600))
    for batch in plans[1].batches:
        assert len(batch) * 5 <= 400


def test_too_few_samples_for_the_ranks_is_an_error() -> None:
    data = PreparedSplit("train", ("unused",), (3,), np.array([[5, 5]] * 3))
    settings = PlanSettings(
        dp_size=4, max_tokens=100, max_len=256, shuffle_buffer=0, sort_buffer=10, seed=1, shuffle=True
    )
    with pytest.raises(DataError, match="rank 3 has 0 samples"):
        plan_epoch(data, settings, epoch=0)


def test_max_len_and_max_tokens_checks(prepared: Path) -> None:
    longest = int(open_prepared(prepared).lengths.max())
    with pytest.raises(DataError, match=rf"max_tokens=16 cannot hold the longest train sample \({longest + 1} tokens"):
        TokenBatchStream(prepared, "train", dp_rank=0, dp_size=1, max_tokens=16)
    with pytest.raises(DataError, match="or set data.max_len to at most 15 to leave longer samples out"):
        TokenBatchStream(prepared, "train", dp_rank=0, dp_size=1, max_tokens=16)
    with pytest.warns(UserWarning, match="longer than max_len=15"):  # the advice taken: the stream runs
        assert take(TokenBatchStream(prepared, "train", dp_rank=0, dp_size=1, max_tokens=16, max_len=15), 1)
    with pytest.warns(UserWarning, match="longer than max_len=10"):
        stream = TokenBatchStream(prepared, "train", dp_rank=0, dp_size=1, max_tokens=256, max_len=10)
    assert stream.excluded > 0
    assert all(len(b.src[0]) <= 11 for b in take(stream, 3))


def test_urls_brace_patterns_and_pipes(prepared: Path) -> None:
    count = epoch_batches(prepared, 0, dp_size=1, **OPTIONS)
    expected = [b.ids for b in take(TokenBatchStream(prepared, "train", dp_rank=0, dp_size=1, **OPTIONS), count)]
    shards = len(open_prepared(prepared).urls)
    pattern = f"pipe:cat {prepared}/train-{{000000..{shards - 1:06d}}}.tar"
    via_pipe = open_prepared(prepared, "train", urls=pattern)
    assert via_pipe.urls[0] == f"pipe:cat {prepared}/train-000000.tar"
    got = [
        b.ids for b in take(TokenBatchStream(via_pipe, "train", dp_rank=0, dp_size=1, num_workers=1, **OPTIONS), count)
    ]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    scanned = scan_shards(f"{prepared}/train-{{000000..{shards - 1:06d}}}.tar")
    assert np.array_equal(scanned.lengths, open_prepared(prepared).lengths)
    with pytest.raises(DataError, match="2 URLs were given"):
        open_prepared(prepared, "train", urls=[f"{prepared}/train-000000.tar"] * 2)


def test_padding_waste_is_small_with_a_large_sort_buffer(prepared: Path) -> None:
    data = open_prepared(prepared)
    small, large = (
        plan_epoch(data, PlanSettings(1, 1024, 256, 100, window, 0, True), 0)[0].batches for window in (200, 100000)
    )
    assert padding_waste(large, data.lengths) < padding_waste(small, data.lengths)
    assert padding_waste(large, data.lengths) < 0.05


def broken_copy(prepared: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    return copy


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("damage", ["truncate", "garbage", "remove"])
def test_broken_shard_is_a_one_line_error_naming_it(prepared: Path, tmp_path: Path, workers: int, damage: str) -> None:
    copy = broken_copy(prepared, tmp_path)
    shard = copy / "train-000002.tar"
    data = shard.read_bytes()
    if damage == "truncate":
        shard.write_bytes(data[: len(data) // 2 + 100])
    elif damage == "garbage":
        shard.write_bytes(data[:20000] + b"\x07" * 5000 + data[25000:])
    else:
        shard.unlink()
    stream = TokenBatchStream(copy, "train", dp_rank=0, dp_size=1, num_workers=workers, **OPTIONS)
    with pytest.raises(DataError) as err:
        for _ in stream:
            pass
    message = str(err.value)
    assert "train-000002.tar" in message and "\n" not in message and "Traceback" not in message


def test_manifest_made_with_another_tokenizer(prepared: Path, one_shard: Path) -> None:
    with pytest.raises(DataError) as err:
        TokenBatchStream(prepared, "train", dp_rank=0, dp_size=1, max_tokens=256, spm=one_shard / "spm.model")
    assert str(prepared / "manifest.json") in str(err.value) and str(one_shard / "spm.model") in str(err.value)
    stream = TokenBatchStream(prepared, "train", dp_rank=0, dp_size=1, max_tokens=256, spm=prepared / "spm.model")
    assert stream.batches_per_epoch() > 0


def test_state_for_another_split_is_refused(prepared: Path) -> None:
    state = TokenBatchStream(prepared, "valid", dp_rank=0, dp_size=1, max_tokens=256).state_dict()
    with pytest.raises(DataError) as err:
        TokenBatchStream(prepared, "train", dp_rank=0, dp_size=1, max_tokens=256).load_state_dict(state)
    # names the data and what to change (it said "stream state is for split valid with N samples")
    assert str(prepared / "manifest.json") in str(err.value) and "position is in split valid" in str(err.value)
    assert "(data.path)" in str(err.value)
