"""Local NVMe tier: one file per block object, an lmdb index as the truth.

Layout under `root`:

    data/<hash hex>        block objects (one flat directory: a batch of puts
                           then costs one directory fsync, not one per file)
    quarantine/            files that failed verification, kept for forensics
    index.lmdb/            hash -> (file size, xxh3_64 of the file, last access ns)
    LOCK                   flock held by the one process that owns the tier

Crash safety: a put writes a temp file in the final directory, fsyncs it,
renames it over the final name and fsyncs the directory; only then does it
commit the index entry. So after any crash every indexed file is complete,
and whatever is on disk but not indexed is garbage. Reads check size and
checksum against the index anyway (bit rot, outside writers): a mismatch is
a miss and the file is quarantined. A damaged index heals
(tiers/disk_index.py): it is set aside and rebuilt from the data files that
the owner's `check` finds whole (the store passes one that reads each
object's own header and checksum), so one damaged file never leaves the
engine without its cache; a missing LOCK file is simply created again.

At scale: the index is the only record of what is held; opening reads its
meta record, not every entry. Access times given by reads reach lmdb with
the next write (tiers/disk_recency.py), and `oldest` finds eviction
candidates among them (the store's "sampled" policy). Lookups, once the
sweep has walked the index, are answered by a presence table of 8 bytes
per block (tiers/presence.py), not by lmdb reads. After opening, a
background sweep (`swept` is set when it is done) removes data files the
index does not know (a crash between a rename and its commit, temp files of
interrupted puts) and quarantines records whose file is missing or has the
wrong size (damage from outside, which a read meets first anyway, as a miss).
"""
from __future__ import annotations

import errno
import logging
import os
import threading
import time
from contextlib import suppress
from itertools import count
from pathlib import Path
from typing import Callable, Iterable, Sequence, TypeVar

import lmdb
import torch
import xxhash

from tiers.arena import Arena
from tiers.base import ByteBudget, Tier
from tiers.disk_index import RECORD, DiskIndex
from tiers.disk_io import (buffers, fsync_all, fsync_dir, lock_root, parse_name, read_file, readers, unlink_quiet,
                           whole_files, write_file)
from tiers.disk_recency import AccessTimes
from tiers.disk_sweep import sweep
from tiers.presence import PresenceTable
from tiers.types import HASH_BYTES, BlockHash, TierKVError, TierUnavailableError

log = logging.getLogger(__name__)

_TMP_PREFIX = ".tmp-"
Check = Callable[[BlockHash, memoryview], bool]  # whether a data file is a whole object of that block
Entry = tuple[int, int, int]  # an unpacked index record
T = TypeVar("T")


class DiskTier(ByteBudget, Tier):
    """Block objects as checksummed files under `root`, indexed by lmdb.

    `fsync` False skips every fsync (tests, throwaway caches): the tier stays
    consistent across process crashes but not across power loss. `map_size`
    bounds the lmdb index (a sparse mapping; 16 GiB indexes ~100M blocks).
    """

    name = "disk"
    verify_payload = False  # sizes and checksums are verified on every read
    rechecks = True  # files can be damaged under the tier
    keeps_recency = True

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, fsync: bool = True,
                 map_size: int = 1 << 34, check: Check | None = None) -> None:
        super().__init__(capacity_bytes)
        self.root = Path(root)
        self.fsync = fsync
        self._check = check
        self._data = self.root / "data"
        self._quarantine_dir = self.root / "quarantine"
        self._make_dirs()
        self._lock_fd = lock_root(self.root)
        try:
            self.index = DiskIndex(self.root / "index.lmdb", map_size, fsync, HASH_BYTES, RECORD.size)
        except TierUnavailableError:
            os.close(self._lock_fd)
            raise
        self._lock = threading.Lock()  # guards the counters, reservations and the presence table
        self.commit_lock = threading.RLock()  # serializes index writes, renames/unlinks in data/, heals
        self._atimes = AccessTimes()  # given by reads, until the next index write (tiers/disk_recency.py)
        self._used = self._blocks = self._reserved = 0
        self.temp_mark = f"-{os.urandom(4).hex()}-"  # in this instance's temp file names: the sweep leaves those alone
        self._seq = count()
        self._arena = Arena()  # read buffers, reused once callers drop what they got
        self._full_logged = -1e9  # last "filesystem full" warning (monotonic s)
        self.closed = False
        self._presence, self.presence_ready = PresenceTable(self.index.size_hint()), False  # filled by the sweep
        self._open_index()
        self.swept = threading.Event()
        self._sweeper = threading.Thread(target=sweep, args=(self,), name="tierkv-disk-sweep", daemon=True)
        self._sweeper.start()

    def _make_dirs(self) -> None:
        new = not self._data.is_dir()  # fsyncing a data/ of millions of files is not free: only a new one
        self._quarantine_dir.mkdir(parents=True, exist_ok=True)
        self._data.mkdir(parents=True, exist_ok=True)
        if self.fsync and new:
            fsync_dir(self._data)
            fsync_dir(self.root)

    def _open_index(self) -> None:
        """Totals from the meta record; an index that is empty beside data
        files (new, set aside, truncated) is rebuilt from them, one without
        a sound meta record recounted."""
        try:
            records, (blocks, _) = self.index.records(), self.index.totals()
            if records == 0 and any(parse_name(f.name) for f in os.scandir(self._data)):
                self._heal(self.index.generation, None)  # new, set aside or emptied beside data files
            elif blocks != records:
                log.warning("disk tier %s: index totals disagree with its %d records; recounting", self.root, records)
                self.index.recount()
        except lmdb.Error as e:
            self._heal(self.index.generation, str(e))
        self._sync_totals()
        self.stats.add(errors=self.index.healed)

    def _heal(self, generation: int, problem: str | None) -> None:
        """Replace the index (damaged as of `generation`; None: empty) with
        one rebuilt from the data files that `check` finds whole; others are removed."""
        with self.commit_lock:
            self._check_open()
            if self.index.generation != generation:
                return  # another thread healed it meanwhile
            kept, found = whole_files(self._data, self._check, skip=self.temp_mark)
            self.index.replace(problem, kept)
            self._atimes.take()
            with self._lock:
                self._presence, self.presence_ready = PresenceTable(len(kept)), True
                self._presence.add(list(kept))
            log.warning("disk tier %s: index rebuilt from %d of %d data files", self.root, len(kept), found)
        self._sync_totals()

    def _sync_totals(self) -> None:
        """Take the counters from the index's totals (after each write)."""
        blocks, used = self.index.totals()
        with self._lock:
            db, du = blocks - self._blocks, used - self._used
            self._blocks, self._used = blocks, used
        self.stats.add(blocks=db, used_bytes=du)

    def _reading(self, read: Callable[[DiskIndex], T]) -> T:
        """`read(index)`, again on the healed index if it met damage."""
        self._check_open()
        generation = self.index.generation
        try:
            return read(self.index)
        except lmdb.Error as e:
            self._heal(generation, str(e))
            return read(self.index)

    def records_of(self, hashes: Sequence[BlockHash]) -> list[Entry | None]:
        """The index record of each hash (None: not held)."""
        raw = self._reading(lambda index: index.get_many(hashes))
        return [RECORD.unpack(v) if v is not None else None for v in raw]

    def _present(self, hashes: Sequence[BlockHash]) -> list[bool]:
        return self._reading(lambda index: index.has_many(hashes))

    def path_of(self, h: BlockHash) -> Path:
        """Where the data file of `h` lives (whether or not it exists)."""
        return self._data / h.hex()

    def put_many(self, hashes: Sequence[BlockHash], objs: Sequence[torch.Tensor]) -> list[bool]:
        todo = self._admit(hashes, objs)
        written = []
        try:
            written = [w for w in (self._write_temp(hashes[i], objs[i]) for i in todo) if w is not None]
            failed = fsync_all([w[4] for w in written]) if self.fsync else [None] * len(written)
            for w, e in zip(written, failed):  # all of the batch's files at once (disk_io.syncers)
                if e is not None:
                    unlink_quiet(w[1])
                    self._write_failed(w[1], e)
            self._commit([w[:4] for w, e in zip(written, failed) if e is None])
        finally:
            for w in written:
                os.close(w[4])
            with self._lock:
                self._reserved -= sum(objs[i].numel() for i in todo)
        return self.contains_many(hashes)

    def _write_temp(self, h: BlockHash, obj: torch.Tensor) -> tuple[BlockHash, Path, int, int, int] | None:
        """Write `obj` under a temp name next to its final path: (hash, temp
        path, size, checksum, open fd for the caller to fsync and close), or
        None if that fails (ENOSPC is a full disk, anything else an error)."""
        data = memoryview(obj.cpu().numpy())
        tmp = self.path_of(h).with_name(f"{_TMP_PREFIX}{h.hex()}{self.temp_mark}{next(self._seq)}")
        try:
            fd = write_file(tmp, data)
        except OSError as e:
            self._write_failed(tmp, e)
            return None
        return h, tmp, len(data), xxhash.xxh3_64_intdigest(data), fd

    def _write_failed(self, tmp: Path, e: OSError) -> None:
        if e.errno == errno.ENOSPC:  # a capacity condition, not an error: say so, but not per block
            now = time.monotonic()
            if now - self._full_logged >= 10.0:
                self._full_logged = now
                log.warning("disk tier %s: filesystem full; writes dropped until space frees up", self.root)
        else:
            log.warning("disk tier %s: writing %s failed: %s", self.root, tmp, e)
            self.stats.add(errors=1)

    def _commit(self, written: list[tuple[BlockHash, Path, int, int]]) -> None:
        """Rename temp files into place, then index them; on failure remove
        them all (a crash in between leaves orphans, which the sweep removes)."""
        if not written:
            return
        with self.commit_lock:
            held = self._present([w[0] for w in written])  # a racing put of the same hash may have won already
            fresh = [w for w, ok in zip(written, held) if not ok]
            try:
                for h, tmp, _, _ in fresh:
                    os.rename(tmp, self.path_of(h))
                if self.fsync and fresh:
                    fsync_dir(self._data)
                puts = {h: RECORD.pack(size, csum, self._atimes.tick()) for h, _, size, csum in fresh}
                ok = self._write_index(puts, [])
            except OSError as e:
                log.warning("disk tier %s: publishing %d files failed: %s", self.root, len(fresh), e)
                ok = False
            finally:
                for _, tmp, _, _ in written:  # beaten by a racing put, or never renamed
                    unlink_quiet(tmp)
            if not ok:
                self.stats.add(errors=1)
                for h, _, _, _ in fresh:
                    unlink_quiet(self.path_of(h))
                return
        self.stats.add(bytes_in=sum(w[2] for w in fresh))

    def delete_many(self, hashes: Iterable[BlockHash]) -> int:
        hashes = list(dict.fromkeys(hashes))
        with self.commit_lock:
            gone = [h for h, e in zip(hashes, self.records_of(hashes)) if e is not None]
            if not gone:
                return 0
            # Index first: a crash before the unlinks leaves orphans, which the sweep removes.
            if not self._write_index({}, gone):
                self.stats.add(errors=1)
            for h in gone:
                unlink_quiet(self.path_of(h))
        return len(gone)

    def _write_index(self, puts: dict[BlockHash, bytes], dels: list[BlockHash]) -> bool:
        """One index write transaction (caller holds the commit lock): `puts`,
        `dels` and the access times gathered since the last one; a damaged
        index is healed and the write applied to the new one."""
        pending = self._atimes.take()
        generation = self.index.generation
        try:
            ok = self.index.write(puts, dels, pending)
        except lmdb.Error as e:
            self._heal(generation, str(e))
            ok = self.index.write(puts, dels)
        if ok:
            with self._lock:
                self._presence.add(list(puts))
                self._presence.discard(dels)
        self._sync_totals()
        return ok

    def get_many(self, hashes: Sequence[BlockHash]) -> list[torch.Tensor | None]:
        """Verified copies of the files; a damaged or missing file is a miss
        and is quarantined."""
        entries = self.records_of(hashes)
        found = [(h, e) for h, e in zip(hashes, entries) if e is not None]
        flush = self._atimes.read(found)
        bufs = buffers(self._arena, [e[0] for _, e in found])
        read = iter(readers().map(self._read, *zip(*found), bufs) if len(found) > 1 else
                    [self._read(h, e, b) for (h, e), b in zip(found, bufs)])
        out: list[torch.Tensor | None] = []
        corrupt = 0
        for h, e in zip(hashes, entries):
            obj = next(read) if e is not None else None
            if obj is None and e is not None:
                corrupt += self._set_aside(h, e)
            out.append(obj)
        hits = [o.numel() for o in out if o is not None]
        self.stats.add(hits=len(hits), misses=len(out) - len(hits), bytes_out=sum(hits), corrupt=corrupt)
        if flush and self.commit_lock.acquire(blocking=False):  # never waits behind a commit
            try:
                self._write_index({}, [])
            finally:
                self.commit_lock.release()
        return out

    def _read(self, h: BlockHash, e: Entry, buf: torch.Tensor) -> torch.Tensor | None:
        """The file's bytes, read into `buf` (e[0] bytes), if its size and
        checksum match record `e`, else None."""
        try:
            return buf if read_file(self.path_of(h), e[0], e[1], buf) else None
        except OSError as err:
            log.warning("disk tier %s: reading %s failed: %s", self.root, h.hex(), err)
            self.stats.add(errors=1)
            return None

    def recheck(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Read held files back; those that fail their checks are quarantined
        and returned (the caller writes them again)."""
        found = [(h, e) for h, e in zip(hashes, self.records_of(hashes)) if e is not None]
        bad = [h for h, e in found
               if self._read(h, e, torch.empty(e[0], dtype=torch.uint8)) is None and self._set_aside(h, e)]
        self.stats.add(corrupt=len(bad))
        return bad

    def quarantine(self, hashes: Iterable[BlockHash]) -> None:
        """Move blocks that failed the store's checks into quarantine/. The
        store counts those; `stats.corrupt` counts this tier's own failures."""
        hashes = list(hashes)
        for h, e in zip(hashes, self.records_of(hashes)):
            if e is not None:
                self._set_aside(h, e, force=True)

    def _set_aside(self, h: BlockHash, e: Entry, force: bool = False) -> bool:
        """Unindex `h` and move its file to quarantine/, unless record `e` was
        deleted or replaced meanwhile, or (unless `force`) the file now reads
        sound: then a reader raced a delete or a re-put, a plain miss."""
        with self.commit_lock:
            if self.closed:
                return False
            now = self.records_of([h])[0]
            if now is None or now[:2] != e[:2]:
                return False
            if not force and self._read(h, now, torch.empty(now[0], dtype=torch.uint8)) is not None:
                return False
            log.warning("disk tier %s: block %s failed verification, quarantined", self.root, h.hex())
            if not self._write_index({}, [h]):
                self.stats.add(errors=1)
            with suppress(FileNotFoundError):
                os.rename(self.path_of(h), self._quarantine_dir / f"{h.hex()}-{os.getpid()}-{next(self._seq)}")
        return True

    def contains_many(self, hashes: Sequence[BlockHash]) -> list[bool]:
        with self._lock:  # the presence table once the sweep has filled it (tiers/presence.py)
            if self.presence_ready:
                return self._presence.contains(hashes)
        return self._present(hashes)

    def learn(self, after: bytes) -> list[tuple[bytes, bytes]]:
        """The sweep's walk: the next records past `after`, added to the
        presence table (under the commit lock, so no write slips between)."""
        with self.commit_lock:
            chunk = self._scan(after)
            with self._lock:
                self._presence.add([k for k, _ in chunk])
                self.presence_ready = self.presence_ready or not chunk
        return chunk

    def keys(self) -> list[BlockHash]:
        """Held hashes, least recently used (read or written) first (reads every record)."""
        return [h for h, _ in sorted(self._atimes.every(self._scan), key=lambda r: r[1])]

    def oldest(self, n: int, draws: int, skip: Callable[[BlockHash], bool] = lambda h: False) -> list[BlockHash]:
        return self._atimes.oldest(n, draws, skip, self._blocks, self._scan,
                                   lambda draw: self._reading(lambda index: index.sample(draw)))

    def _scan(self, after: bytes) -> list[tuple[bytes, bytes]]:
        return self._reading(lambda index: index.scan(after))

    def close(self) -> None:
        """Flush last-access times, stop the sweep, close the index and release the root."""
        with self.commit_lock:
            if self.closed:
                return
            if self._atimes.waiting():
                self._write_index({}, [])
            self.closed = True
        self._sweeper.join()
        with self.commit_lock:
            self.index.close()
            os.close(self._lock_fd)

    def _check_open(self) -> None:
        if self.closed:
            raise TierKVError(f"disk tier {self.root} is closed")
