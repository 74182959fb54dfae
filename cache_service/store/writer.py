"""Background writers: one thread and one bounded queue per lower tier.

The store hands a writer (hash, object) pairs; the writer batches them,
asks the store to make room and puts them in its tier. Until a write
completes the object stays in the store's in-flight map, so a block never
disappears from lookups while it moves down.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Sequence

import torch

from tiers.types import BlockHash

log = logging.getLogger("tierkv.writer")
Item = tuple[BlockHash, torch.Tensor]


WRITE_BATCH = 256  # items per write: a tier's fixed cost per batch (a directory fsync, an index commit) amortized
SLOW_BPS = 10 << 20  # a writer slower than this on its batch, past its grace, is stuck (submit_many's stuck_s)


class TierWriter:
    """Drains its queue into `write(batch)`; `write` is the store's persist
    function. Items are queued many at a time (`submit_many`): one lock
    hold per batch, where a queue.Queue takes two condition rounds per item."""

    def __init__(self, name: str, depth: int, write: Callable[[Sequence[Item]], None], batch: int = WRITE_BATCH,
                 tick: Callable[[], bool | None] | None = None, tick_s: float = 1.0) -> None:
        assert depth > 0 and batch > 0
        self.name = name
        self._depth_limit = depth
        self._items: deque[Item] = deque()
        self._current: list[Item] = []  # the batch being written
        self._busy: tuple[float, int] | None = None  # (since when, bytes) of the batch or tick under way
        self._unfinished = 0  # queued, or in the batch being written
        self._stopping = False
        self._cond = threading.Condition()
        self._write = write
        self._batch = batch
        self._tick, self._tick_s = tick, tick_s  # run on this thread every tick_s; True: again after a batch
        self._next_tick = time.monotonic() + tick_s
        self._thread = threading.Thread(target=self._run, name=f"tierkv-writer-{name}", daemon=True)
        self._thread.start()

    def submit(self, item: Item, wait: bool) -> bool:
        """Queue one object; False when the queue is full and `wait` is False."""
        return self.submit_many([item], wait) == 1

    def submit_many(self, items: Sequence[Item], wait: bool, stuck_s: float | None = None) -> int:
        """Queue objects in order; how many were queued: all of them when
        `wait` (waiting for room as the writer drains), else those that fit;
        with `stuck_s`, the wait ends once the writer is stuck: on one batch
        (or tick) for `stuck_s` more than its bytes take at SLOW_BPS (a tier
        that hangs, not one that is slow)."""
        done = 0
        with self._cond:
            while done < len(items):
                room = self._depth_limit - len(self._items)
                if room <= 0:
                    left = None if stuck_s is None or self._busy is None else \
                        self._busy[0] + stuck_s + self._busy[1] / SLOW_BPS - time.monotonic()
                    if not wait or (left is not None and left <= 0):
                        break
                    self._cond.wait(left)
                    continue
                take = items[done:done + room]
                self._items.extend(take)
                self._unfinished += len(take)
                done += len(take)
                self._cond.notify_all()
        return done

    def depth(self) -> int:
        """Objects not yet written: queued, or in the batch being written."""
        return self._unfinished

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued object is written (or `timeout` passes)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._unfinished == 0, timeout)

    def unwritten(self) -> list[Item]:
        """Take what is still queued out of the queue (it will not be written
        here), with the batch being written now (left to its write): a
        closing store journals them."""
        with self._cond:
            queued = list(self._items)
            self._items.clear()
            self._unfinished -= len(queued)
            self._cond.notify_all()
            return self._current + queued

    def stop(self, timeout: float | None = None) -> None:
        self.flush(timeout)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _next_batch(self) -> tuple[list[Item], bool]:
        with self._cond:
            if not self._items and not self._stopping:
                self._cond.wait(self._tick_s if self._tick else None)
            n = min(self._batch, len(self._items))
            batch = self._current = [self._items.popleft() for _ in range(n)]
            if batch:
                self._busy = (time.monotonic(), sum(obj.numel() for _, obj in batch))
                self._cond.notify_all()  # room for waiting submitters
            return batch, self._stopping and not self._items

    def _done(self, n: int) -> None:
        with self._cond:
            self._current, self._busy = [], None
            self._unfinished -= n
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            batch, stop = self._next_batch()
            try:
                if batch:
                    self._write(batch)
            except Exception:  # dispatch boundary: a failed lower copy is a future miss, never a crash
                log.exception("writer %s: batch of %d failed", self.name, len(batch))
            finally:
                if batch:
                    self._done(len(batch))
            if stop:
                return
            self._maybe_tick()

    def _maybe_tick(self) -> None:
        if self._tick is None or time.monotonic() < self._next_tick:
            return
        self._next_tick = time.monotonic() + self._tick_s
        with self._cond:
            self._busy = (time.monotonic(), 0)
        try:
            if self._tick():  # it yielded to queued work with more of its own left: again after the next batch
                self._next_tick = time.monotonic()
        except Exception:  # dispatch boundary, as for a batch
            log.exception("writer %s: periodic work failed", self.name)
        finally:
            with self._cond:
                self._busy = None
                self._cond.notify_all()
