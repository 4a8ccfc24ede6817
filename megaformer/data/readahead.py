"""The stream's decoded samples, and a thread that keeps batches ready before they are asked for.

:class:`SampleStore` holds the samples the loader workers have decoded and no batch has
taken yet, by ``(epoch, sample)``. A batch of a length-sorted window can hold samples
from anywhere in that window, so the first batch of a window needs the whole window
decoded: read only on demand, it would wait for that at every window and epoch boundary.

:class:`ReadAhead` therefore runs the stream's batch assembly in a thread of the rank's
process, ``depth`` batches ahead of the consumer (collated, and pinned for a GPU), and
while that queue is full it keeps pulling chunks into the store, up to ``limit``
samples: the next window is decoded while the current one is consumed, and the next
epoch's chunks come from the same, persistent workers. The consumer only takes ready
batches; the stream's position is still counted by the consumer, so a checkpoint never
counts a batch that was read ahead but not handed out.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

import numpy as np

from megaformer.data.workers import Chunk, EpochEnd, Failure
from megaformer.errors import DataError

Item = TypeVar("Item")
Pair = tuple[np.ndarray, np.ndarray]


class SampleStore:
    """Decoded samples by epoch and sample id, filled from the workers' chunks as they are needed.

    ``chunks`` yields :class:`Chunk`, :class:`EpochEnd` and :class:`Failure` items from
    ``workers`` workers; ``check`` refuses a chunk whose lengths do not match the index;
    ``samples`` is the split's size. :meth:`close` releases ``chunks`` (a DataLoader's
    iterator shuts its workers down when released).
    """

    def __init__(
        self,
        chunks: Iterator[Chunk | EpochEnd | Failure],
        workers: int,
        samples: int,
        check: Callable[[Chunk], None],
    ) -> None:
        self._chunks, self._workers, self._samples, self._check = chunks, workers, samples, check
        self._pairs: dict[int, dict[int, Pair]] = {}  # epoch -> sample id -> (src, tgt)
        self._have: dict[int, np.ndarray] = {}  # epoch -> bool per sample: decoded, not yet taken
        self._ended: dict[int, int] = {}  # epoch -> workers that sent all of it
        self.exhausted = False
        self.held = 0  # samples decoded and not yet taken

    def pull(self) -> bool:
        """Receive one item from the workers into the store; False once they have nothing more."""
        if self.exhausted:
            return False
        item = next(self._chunks, None)
        if item is None:
            self.exhausted = True
            return False
        if isinstance(item, Failure):
            raise DataError(item.message)
        if isinstance(item, EpochEnd):
            self._ended[item.epoch] = self._ended.get(item.epoch, 0) + 1
            return True
        self._check(item)
        have = self._have.get(item.epoch)
        if have is None:
            have = self._have[item.epoch] = np.zeros(self._samples, dtype=bool)
        have[item.ids] = True
        self._pairs.setdefault(item.epoch, {}).update((i, (src, tgt)) for i, src, tgt in item.unpack())
        self.held += len(item.ids)
        return True

    def wait_for(self, epoch: int, ids: np.ndarray, split: str) -> None:
        """Pull until the samples ``ids`` of ``epoch`` are all decoded; a DataError if the workers end without one."""
        while epoch not in self._have or not self._have[epoch][ids].all():
            if self._ended.get(epoch, 0) >= self._workers or not self.pull():
                have = self._have.get(epoch, np.zeros(self._samples, dtype=bool))
                raise DataError(f"split {split}: sample {int(ids[~have[ids]][0])} was not found in the shards")

    def take(self, epoch: int, ids: np.ndarray, split: str) -> list[Pair]:
        """The samples ``ids`` of ``epoch`` (pulling until they are all decoded), removed from the store."""
        self.wait_for(epoch, ids, split)
        pairs, have = self._pairs[epoch], self._have[epoch]
        taken = [pairs.pop(int(i)) for i in ids]
        have[ids] = False
        self.held -= len(ids)
        if not pairs and self._ended.get(epoch, 0) >= self._workers:
            del self._pairs[epoch], self._have[epoch]  # an epoch fully handed out
        return taken

    def close(self) -> None:
        self._chunks = iter(())
        self.exhausted = True


class ReadAhead(Generic[Item]):
    """Iterates ``items`` in a thread, up to ``depth`` items ahead of the consumer.

    While the queue is full, ``idle()`` is called until it returns False (the store pulls
    the next chunks, up to its limit); then the thread waits for the consumer. An error in
    the thread reaches the consumer after the items that came before it. :meth:`close`
    stops the thread and closes ``items`` (which stops the workers).
    """

    def __init__(self, items: Iterator[Item], depth: int, idle: Callable[[], bool], name: str) -> None:
        self._items, self._depth, self._idle = items, depth, idle
        self._queue: deque[Item] = deque()
        self._done = False
        self._error: BaseException | None = None
        self._stop = False
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for item in self._items:
                self._wait_for_room()
                with self._ready:
                    if self._stop:
                        return
                    self._queue.append(item)
                    self._ready.notify_all()
        except BaseException as err:  # handed to the consumer, which raises it
            with self._ready:
                self._error = err
        finally:
            close = getattr(self._items, "close", None)
            if close is not None:
                close()
            with self._ready:
                self._done = True
                self._ready.notify_all()

    def _wait_for_room(self) -> None:
        """Block while the queue is full, doing the idle work (reading on) until there is none left."""
        more = True
        while True:
            with self._ready:
                if self._stop or len(self._queue) < self._depth:
                    return
                if not more:
                    self._ready.wait(timeout=0.5)
                    continue
            more = self._idle()

    def __iter__(self) -> Iterator[Item]:
        return self

    def __next__(self) -> Item:
        with self._ready:
            while not self._queue and not self._done:
                self._ready.wait()
            if self._queue:
                item = self._queue.popleft()
                self._ready.notify_all()
                return item
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            raise StopIteration

    def close(self, timeout: float = 30.0) -> None:
        """Stop the thread (after the item it is on) and wait for it to close the items' source."""
        with self._ready:
            self._stop = True
            self._queue.clear()
            self._ready.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
