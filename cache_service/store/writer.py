"""Background writers: one thread and one bounded queue per lower tier.

The store hands a writer (hash, object) pairs; the writer batches them,
asks the store to make room and puts them in its tier. Until a write
completes the object stays in the store's in-flight map, so a block never
disappears from lookups while it moves down.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Sequence

import torch

from tiers.types import BlockHash

log = logging.getLogger("tierkv.writer")
_STOP = object()
Item = tuple[BlockHash, torch.Tensor]


WRITE_BATCH = 256  # items per write: a tier's fixed cost per batch (a directory fsync, an index commit) amortized


class TierWriter:
    """Drains `q` into `write(batch)`; `write` is the store's persist function."""

    def __init__(self, name: str, depth: int, write: Callable[[Sequence[Item]], None], batch: int = WRITE_BATCH,
                 tick: Callable[[], bool | None] | None = None, tick_s: float = 1.0) -> None:
        self.name = name
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self._write = write
        self._batch = batch
        self._tick, self._tick_s = tick, tick_s  # run on this thread every tick_s; True: again after a batch
        self._next_tick = time.monotonic() + tick_s
        self._thread = threading.Thread(target=self._run, name=f"tierkv-writer-{name}", daemon=True)
        self._thread.start()

    def submit(self, item: Item, wait: bool) -> bool:
        """Queue one object; False when the queue is full and `wait` is False."""
        try:
            self.q.put(item, block=wait)
            return True
        except queue.Full:
            return False

    def depth(self) -> int:
        """Objects not yet written: queued, or in the batch being written."""
        return self.q.unfinished_tasks

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued object is written (or `timeout` passes)."""
        done = threading.Event()
        threading.Thread(target=lambda: (self.q.join(), done.set()), daemon=True).start()
        return done.wait(timeout)

    def stop(self, timeout: float | None = None) -> None:
        self.flush(timeout)
        self.q.put(_STOP)
        self._thread.join(timeout)

    def _next_batch(self) -> tuple[list[Item], bool]:
        try:
            items = [self.q.get(timeout=self._tick_s if self._tick else None)]
        except queue.Empty:
            return [], False
        while len(items) < self._batch:
            try:
                items.append(self.q.get_nowait())
            except queue.Empty:
                break
        stop = any(it is _STOP for it in items)
        return [it for it in items if it is not _STOP], stop

    def _run(self) -> None:
        while True:
            batch, stop = self._next_batch()
            try:
                if batch:
                    self._write(batch)
            except Exception:  # dispatch boundary: a failed lower copy is a future miss, never a crash
                log.exception("writer %s: batch of %d failed", self.name, len(batch))
            finally:
                for _ in range(len(batch) + (1 if stop else 0)):
                    self.q.task_done()
            if stop:
                return
            self._maybe_tick()

    def _maybe_tick(self) -> None:
        if self._tick is None or time.monotonic() < self._next_tick:
            return
        self._next_tick = time.monotonic() + self._tick_s
        try:
            if self._tick():  # it yielded to queued work with more of its own left: again after the next batch
                self._next_tick = time.monotonic()
        except Exception:  # dispatch boundary, as for a batch
            log.exception("writer %s: periodic work failed", self.name)
