"""Streamed calls that stall are cancelled, so a client cannot hold a worker.

The daemon has a fixed pool of gRPC workers (``server.workers``). A Store
stream whose client sends nothing more, or a Load stream whose client stops
reading (its flow-control window fills and the send waits), held one of them
until the client's own deadline, which may be never: 16 such calls and every
other client hung. A call whose stream makes no progress for
``server.stream_idle_s`` (no request message taken, or a reply message not
taken by the client) is cancelled; its client sees CANCELLED.

One thread checks every watched call a few times per idle period; arming
and disarming a watch is a dict write, cheap enough per message.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Iterable, Iterator, TypeVar

log = logging.getLogger("tierkv.server")
T = TypeVar("T")


class StallGuard:
    """Cancels watched calls idle for `idle_s` (see the module docstring). Thread-safe."""

    def __init__(self, idle_s: float) -> None:
        assert idle_s > 0
        self.idle_s, self.cancelled = idle_s, 0
        self._lock, self._ids = threading.Lock(), itertools.count()
        self._deadlines: dict[int, tuple[float, object]] = {}  # watch id -> (deadline, gRPC context)
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    def requests(self, context, it: Iterable[T]) -> Iterator[T]:
        """`it` (a call's request messages), the call cancelled if the next one takes longer than idle_s."""
        key, it = next(self._ids), iter(it)
        try:
            while True:
                self._arm(key, context)
                try:
                    msg = next(it)
                except StopIteration:
                    return
                finally:
                    self._disarm(key)
                yield msg
        finally:
            self._disarm(key)

    def replies(self, context, it: Iterable[T]) -> Iterator[T]:
        """`it` (a call's reply messages), the call cancelled if one is not taken within idle_s."""
        key = next(self._ids)
        try:
            for msg in it:
                self._arm(key, context)
                yield msg  # resumed once gRPC sent it (flow control lets it out)
                self._disarm(key)
        finally:
            self._disarm(key)

    def close(self) -> None:
        self._closed.set()

    def _arm(self, key: int, context) -> None:
        with self._lock:
            self._deadlines[key] = (time.monotonic() + self.idle_s, context)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tierkv-stalls", daemon=True)
                self._thread.start()

    def _disarm(self, key: int) -> None:
        with self._lock:
            self._deadlines.pop(key, None)

    def _run(self) -> None:
        while not self._closed.wait(min(1.0, self.idle_s / 4)):
            now = time.monotonic()
            with self._lock:
                stalled = [k for k, (deadline, _) in self._deadlines.items() if deadline <= now]
                contexts = [self._deadlines.pop(k)[1] for k in stalled]
            for context in contexts:
                self.cancelled += 1
                log.info("stalled stream cancelled", extra={"fields": {"idle_s": self.idle_s}})
                context.cancel()
