"""The S3 tier's deletes (tiers/s3.py), and those it could not send: S3 was
down, or refused them. Each such key is kept to send again from the tier's
`tick` once S3 answers, so a deleted block does not come back to another
node, and dropped when the block is stored again (its new object is not to
be deleted). Kept in memory only, bounded (the oldest go first): past a
restart the bucket's lifecycle rule reclaims what was left."""
from __future__ import annotations

import itertools
import threading
from typing import Callable, Iterable

from botocore.exceptions import BotoCoreError, ClientError

from tiers import s3_io
from tiers.base import TierStats
from tiers.s3_io import MISSING, Outage, Throttled, error_code
from tiers.types import BlockHash

TICK_BATCHES = 4  # of DELETE_BATCH keys: a backlog of 100k deletes held the S3 writer for 12 s in one tick


class PendingDeletes:
    """S3 keys whose delete is still to be sent, oldest first. Thread-safe."""

    def __init__(self, limit: int) -> None:
        self._keys: dict[str, None] = {}
        self._limit = limit
        self._lock = threading.Lock()

    def add(self, keys: Iterable[str]) -> None:
        with self._lock:
            self._keys.update(dict.fromkeys(keys))
            while len(self._keys) > self._limit:
                self._keys.pop(next(iter(self._keys)))

    def discard(self, key: str) -> None:
        """The key's block was stored again: its delete is not to be sent."""
        with self._lock:
            self._keys.pop(key, None)

    def take(self, n: int) -> list[str]:
        """Up to n of the oldest keys, no longer pending (`add` them back if their delete fails)."""
        with self._lock:
            keys = list(itertools.islice(self._keys, n))
            for k in keys:
                del self._keys[k]
            return keys

    def __len__(self) -> int:
        return len(self._keys)


class S3Deletes:
    """Deletes and quarantine of `S3Tier` (a mixin over its client and view)."""

    bucket: str
    prefix: str
    stats: TierStats
    _client: object
    _lock: threading.Lock
    _warn: Throttled
    _undeleted: PendingDeletes
    _outage: Outage
    key_of: Callable[..., str]
    _candidates: Callable[[BlockHash], list[str]]
    _forget: Callable[[Iterable[BlockHash]], int]
    _usable: Callable[[], bool]
    _fail: Callable[[str, str, Exception], None]
    _check_open: Callable[[], None]

    def delete_many(self, hashes: Iterable[BlockHash]) -> int:
        """Delete the objects (known to this node or not: another node may
        have written them); returns how many this node knew of. The block is
        forgotten here at once; a delete S3 did not take (down, failing) is
        sent again from `tick` until it does, so the block does not come back
        (in this process: past a restart, the lifecycle rule reclaims it)."""
        hashes = list(dict.fromkeys(hashes))
        keys = [self.key_of(h, ns) for h in hashes for ns in self._candidates(h)]
        with self._lock:
            self._check_open()
            known = self._forget(hashes)
        for start in range(0, len(keys), s3_io.DELETE_BATCH):
            self._delete_keys(keys[start:start + s3_io.DELETE_BATCH])
        return known

    def _delete_keys(self, keys: list[str]) -> bool:
        """Delete `keys`; those S3 did not take are kept to send again. False: some were not taken."""
        if not keys:
            return True
        if not self._usable():
            self.stats.add(errors=len(keys))
            return self._undelete(keys)
        try:
            failed = [err.get("Key") for err in s3_io.delete_keys(self._client, self.bucket, keys)]
            self._outage.answered()
        except (BotoCoreError, ClientError) as e:
            self._fail("delete", f"{len(keys)} keys", e)
            self.stats.add(errors=len(keys) - 1)
            return self._undelete(keys)
        if failed:
            self.stats.add(errors=len(failed))
            self._warn.warn("s3 tier: %d deletes failed, first: %s", len(failed), failed[0])
            return self._undelete([k for k in failed if k])
        return True

    def _undelete(self, keys: list[str]) -> bool:
        self._undeleted.add(keys)
        return False

    def tick(self) -> None:
        """Send again the deletes S3 did not take: a few batches per tick (the
        writer's uploads wait meanwhile), stopping at one that fails."""
        for _ in range(TICK_BATCHES):
            keys = self._undeleted.take(s3_io.DELETE_BATCH)
            if not keys or not self._delete_keys(keys):
                return

    def quarantine(self, hashes: Iterable[BlockHash]) -> None:
        """Copy objects that failed the store's checks to
        ``<prefix>/quarantine/<hash>-<ns>`` (for inspection), then delete them."""
        hashes = list(hashes)
        for h in hashes:
            if not self._usable():
                break
            try:
                s3_io.copy_aside(self._client, self.bucket, self.key_of(h), f"{self.prefix}/quarantine/{h.hex()}")
            except (BotoCoreError, ClientError) as e:
                if error_code(e) not in MISSING:
                    self._fail("quarantine", h.hex(), e)
        self.delete_many(hashes)
