"""The upload journal: blocks a durable remote tier (S3) must get, kept on
local disk until it has them.

Without it, a block S3 refused during an outage was remembered only in
memory (a hash, its bytes in the tiers above): a restart forgot it, and a
block evicted from the local disk while S3 was down had nowhere to be read
back from. With it, `Placement` records (hash, object) here, in one lmdb
transaction per batch, committed before the batch's write counts as done:

- when tier i refuses a write (down, or failing);
- before a block bound for tier i by write-back leaves the tier above it
  (an eviction victim that tier i does not hold yet);

and forgets an entry once tier i holds the block. The store's writer for
tier i retries the oldest entries on its tick, across outages and restarts
(entries are read back from this file, not from the tiers above).

Bound: lmdb's map is the configured size, so the file never outgrows it. A
record past the bound is refused and counted (``refused``): the block is
then remembered in memory only (as without a journal) and, when it was an
eviction victim, counted as lost if it never reaches S3. The bound is never
backpressure on the engine: a cache must not stall inference for S3.

A journal that cannot be read at open (damaged) is set aside and started
empty, logged: its blocks may still be in the tiers above.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Sequence

import lmdb
import torch

from cache_service.store.writer import Item
from tiers.types import BlockHash

log = logging.getLogger("tierkv.journal")

_MIN_BYTES = 1 << 20  # lmdb's own pages (meta, branch pages, free list) need room too


def _footprint(nbytes: int, page: int) -> int:
    """Bytes an entry of `nbytes` takes in lmdb pages of `page` bytes: its own
    pages past about half a page, else its share of a leaf."""
    return -(-(nbytes + 64) // page) * page if nbytes > page // 2 - 48 else nbytes + 64


class UploadJournal:
    """Objects awaiting one tier, in lmdb at `path` (a directory): entries
    up to `limit_bytes` less a reserve, the file at most `file_limit` (the
    bound and a reserve past it; the reserves: max(256 KiB, 1/8 of the
    bound), for deletes). Thread-safe."""

    def __init__(self, path: str | os.PathLike, limit_bytes: int, fsync: bool = True) -> None:
        assert limit_bytes >= _MIN_BYTES, "a journal smaller than lmdb's own pages"
        self.path, self.limit_bytes, self._fsync = Path(path), limit_bytes, fsync
        self.refused = 0  # records refused at the bound
        # past the entries' bound, for deletes and the pages lmdb frees but cannot reuse yet: a full map
        # refuses deletes too, and a journal that cannot drop what landed stays full for good
        self._reserve = max(_MIN_BYTES // 4, limit_bytes // 8)
        self.file_limit = limit_bytes + self._reserve
        self._lock = threading.Lock()
        self._sizes: OrderedDict[BlockHash, int] = OrderedDict()  # oldest first (by this process's clock)
        self._env = self._open()

    def _open(self) -> lmdb.Environment:
        try:
            env = self._env_at()
            with env.begin(buffers=True) as txn:
                self._sizes.update((BlockHash(bytes(k)), len(v)) for k, v in txn.cursor())
            return env
        except lmdb.Error as e:
            aside = self.path.with_name(f"{self.path.name}.damaged-{time.time_ns()}")
            for old in self.path.parent.glob(f"{self.path.name}.damaged-*"):
                shutil.rmtree(old, ignore_errors=True)
            os.rename(self.path, aside)
            log.warning("upload journal %s is damaged (%s): moved to %s, started empty", self.path, e, aside.name)
            self._sizes.clear()
            return self._env_at()

    def _env_at(self) -> lmdb.Environment:
        self.path.mkdir(parents=True, exist_ok=True)
        return lmdb.open(str(self.path), map_size=self.file_limit, subdir=True, sync=self._fsync,
                         metasync=self._fsync, readahead=False, max_dbs=0)

    def __len__(self) -> int:
        with self._lock:
            return len(self._sizes)

    def __contains__(self, h: object) -> bool:
        with self._lock:
            return h in self._sizes

    def held(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Those of `hashes` the journal holds."""
        with self._lock:
            return [h for h in hashes if h in self._sizes]

    def stats(self) -> dict[str, int]:
        with self._lock:
            n, nbytes = len(self._sizes), sum(self._sizes.values())
        return {"journal_blocks": n, "journal_bytes": nbytes, "journal_refused": self.refused}

    def record(self, items: Sequence[Item]) -> list[BlockHash]:
        """Record (hash, object) pairs durably; the hashes recorded (held
        before, or written now). The rest were refused at the bound."""
        with self._lock:
            new = [(h, obj) for h, obj in items if h not in self._sizes]
            done = [h for h, _ in items if h in self._sizes]
        if new and not self._put(new):  # past the bound as a batch: as many as fit, one at a time
            for k, item in enumerate(new):
                if not self._put([item]):
                    self.refused += len(new) - k
                    log.warning("upload journal %s is full (%d bytes): %d blocks refused, kept in memory only",
                                self.path, self.limit_bytes, len(new) - k)
                    new = new[:k]
                    break
        with self._lock:
            for h, obj in new:
                self._sizes[h] = obj.numel()
        return done + [h for h, _ in new]

    def _put(self, items: Sequence[Item]) -> bool:
        page = self._env.stat()["psize"]
        need = sum(_footprint(obj.numel(), page) for _, obj in items)
        if self._live_bytes() + need > self.limit_bytes - self._reserve:
            return False  # a reserve short of the bound, and another past it (the file's): pages for deletes
        try:
            with self._env.begin(write=True) as txn:
                for h, obj in items:
                    txn.put(bytes(h), memoryview(obj.contiguous().numpy()))
            return True
        except lmdb.MapFullError:
            return False
        except lmdb.Error as e:  # the disk refused (full, failing): as good as full
            log.warning("upload journal %s: write failed: %s", self.path, e)
            return False

    def _live_bytes(self) -> int:
        """Bytes of the pages the entries use now (freed pages not counted: lmdb reuses them)."""
        st = self._env.stat()
        return (st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"] + 4) * st["psize"]

    def forget(self, hashes: Sequence[BlockHash]) -> None:
        """Drop entries (their tier holds them now, or they were deleted)."""
        with self._lock:
            gone = [h for h in hashes if self._sizes.pop(h, None) is not None]
        if gone:
            try:
                with self._env.begin(write=True) as txn:
                    for h in gone:
                        txn.delete(bytes(h))
            except lmdb.Error as e:  # left behind: uploaded again after a restart, which is harmless
                log.warning("upload journal %s: forgetting %d entries failed: %s", self.path, len(gone), e)

    def oldest(self, n: int) -> list[BlockHash]:
        """Up to n held hashes, oldest first."""
        with self._lock:
            return [h for h, _ in zip(self._sizes, range(n))]

    def read(self, hashes: Sequence[BlockHash]) -> tuple[list[Item], list[BlockHash]]:
        """((hash, object) of each of `hashes` the journal holds, those it
        does not hold). A read that fails leaves the rest in neither list:
        an error may pass, and their entries stand."""
        out, missing = [], []
        try:
            with self._env.begin(buffers=True) as txn:
                for h in hashes:
                    v = txn.get(bytes(h))
                    if v is None:
                        missing.append(h)
                    else:
                        out.append((h, torch.frombuffer(bytearray(v), dtype=torch.uint8)))
        except lmdb.Error as e:
            log.warning("upload journal %s: reading failed: %s", self.path, e)
        return out, missing

    def file_bytes(self) -> int:
        """The journal file's size on disk (what its bound limits)."""
        f = self.path / "data.mdb"
        return f.stat().st_size if f.exists() else 0

    def close(self) -> None:
        self._env.close()
