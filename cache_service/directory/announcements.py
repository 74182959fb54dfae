"""Re-announcements of what a node holds, paced: after Redis lost its data
(or this node's registration expired) a node publishes every block its disk
holds again. A disk holds millions; queued at once they would pass the
directory's update bound (the oldest dropped) and flood Redis. So they wait
here, whole lists by reference, and the directory thread takes them in
batches, no faster than `per_s` blocks a second, between its heartbeats
and the live updates (cache_service/directory/redis_directory.py)."""
from __future__ import annotations

import time
from collections import deque
from typing import Sequence

from tiers.types import BlockHash

Update = tuple[bool, str, BlockHash]  # (added, location, hash), as the directory queues them


class Announcements:
    """Lists of (location, hashes) to publish again, taken at a bounded rate."""

    def __init__(self, per_s: float = 20_000.0) -> None:
        self.per_s = per_s
        self._lists: deque[list] = deque()  # [location, hashes, next index]
        self._next = 0.0  # monotonic time the next batch may go

    def __bool__(self) -> bool:
        return bool(self._lists)

    def add(self, location: str, hashes: Sequence[BlockHash]) -> None:
        """Publish `hashes` at `location` again (a newer list for a location replaces a waiting one)."""
        for entry in list(self._lists):
            if entry[0] == location:
                self._lists.remove(entry)
        if hashes:
            self._lists.append([location, hashes, 0])

    def due_in(self) -> float | None:
        """Seconds until the next batch may be taken (None: nothing waits)."""
        return max(0.0, self._next - time.monotonic()) if self._lists else None

    def take(self, n: int) -> list[Update]:
        """Up to n updates, if the rate allows now (else none)."""
        out: list[Update] = []
        while self._lists and len(out) < n and time.monotonic() >= self._next:
            entry = self._lists[0]
            location, hashes, k = entry
            chunk = hashes[k:k + n - len(out)]
            out += [(True, location, h) for h in chunk]
            entry[2] = k + len(chunk)
            if entry[2] >= len(hashes):
                self._lists.popleft()
        if out:
            self._next = time.monotonic() + len(out) / self.per_s
        return out
