"""A daemon that stops answering costs the engine one timeout, not one per call.

The engine calls the cache inside its step: a daemon that hangs (SIGSTOP, a
stalled host) made every lookup, load and store wait out the client's
timeout (30 s) in turn, and every request in the batch with them, while the
engine's own health check said all was well. After a call fails the way a
daemon that is gone or hung fails (no answer in time, unreachable), the
breaker is open: lookups and loads miss and stores are dropped at once, and
a thread of its own probes the daemon (a Hello, a short deadline) every
`every_s` until it answers, which closes the breaker.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)


class Breaker:
    """Open after a failure that looks like a gone daemon, until `probe` succeeds (see the module docstring)."""

    def __init__(self, probe: Callable[[], object], name: str, every_s: float = 1.0) -> None:
        self._probe, self.name, self.every_s = probe, name, every_s
        self._open = threading.Event()
        self._stopped = threading.Event()
        self._lock = threading.Lock()

    @property
    def open(self) -> bool:
        return self._open.is_set()

    def trip(self) -> None:
        """The daemon did not answer: fail fast until a probe sees it again."""
        with self._lock:
            if self._stopped.is_set() or self._open.is_set():
                return
            self._open.set()
            threading.Thread(target=self._run, name="tierkv-breaker", daemon=True).start()
        log.warning("tierkv daemon %s is not answering: the cache is skipped until it does", self.name)

    def close(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(self.every_s):
            try:
                self._probe()
            except Exception:  # still not answering: probe again
                continue
            self._open.clear()
            log.warning("tierkv daemon %s answers again: the cache is back", self.name)
            return
