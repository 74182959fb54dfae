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
and whatever is on disk but not indexed is garbage that opening removes.
Reads check size and checksum against the index anyway (bit rot, outside
writers): a mismatch is a miss and the file is quarantined. A damaged index
heals (tiers/disk_index.py): it is set aside and rebuilt from the data files
that the owner's `check` finds whole (the store passes one that reads each
object's own header and checksum), so one damaged file never leaves the
engine without its cache; a missing LOCK file is simply created again.

An in-memory mirror of the index answers lookups; last-access times are
updated there and reach lmdb with the next write transaction (put, delete,
quarantine, close), so a read never waits for a commit.
"""
from __future__ import annotations

import errno
import logging
import os
import struct
import threading
import time
from contextlib import suppress
from itertools import count
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
import xxhash

from tiers.arena import Arena
from tiers.base import ByteBudget, Tier
from tiers.disk_index import DiskIndex
from tiers.disk_io import buffers, fsync_dir, lock_root, parse_name, readers, unlink_quiet
from tiers.types import HASH_BYTES, BlockHash, TierKVError, TierUnavailableError

log = logging.getLogger(__name__)

_ENTRY = struct.Struct("<QQQ")  # file size, xxh3_64 of the file bytes, last access (ns since epoch)
_TMP_PREFIX = ".tmp-"
Check = Callable[[BlockHash, memoryview], bool]  # whether a data file is a whole object of that block


class _Entry:
    """One indexed file. Identity matters: a reader that raced a delete or a
    re-put sees a different object and must not quarantine the new file."""

    __slots__ = ("size", "csum", "atime")

    def __init__(self, size: int, csum: int, atime: int) -> None:
        self.size, self.csum, self.atime = size, csum, atime

    def pack(self) -> bytes:
        return _ENTRY.pack(self.size, self.csum, self.atime)


class DiskTier(ByteBudget, Tier):
    """Block objects as checksummed files under `root`, indexed by lmdb.

    `fsync` False skips every fsync (tests, throwaway caches): the tier stays
    consistent across process crashes but not across power loss. `map_size`
    bounds the lmdb index (a sparse mapping; 16 GiB indexes ~100M blocks).
    """

    name = "disk"
    verify_payload = False  # sizes and checksums are verified on every read
    rechecks = True  # files can be damaged under the tier

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
            self._db = DiskIndex(self.root / "index.lmdb", map_size, fsync, HASH_BYTES, _ENTRY.size)
        except TierUnavailableError:
            os.close(self._lock_fd)
            raise
        self._lock = threading.Lock()  # guards the mirror, reservations and the clock
        self._commit_lock = threading.Lock()  # serializes index writes and renames/unlinks in data/
        self._index: dict[BlockHash, _Entry] = {}
        self._dirty: set[BlockHash] = set()  # atime changed since the last index write
        self._used = 0
        self._reserved = 0  # bytes of puts in flight
        self._clock = 0
        self._seq = count()
        self._arena = Arena()  # read buffers, reused once callers drop what they got
        self._full_logged = -1e9  # last "filesystem full" warning (monotonic s)
        self._closed = False
        self._recover()

    def _make_dirs(self) -> None:
        self._quarantine_dir.mkdir(parents=True, exist_ok=True)
        self._data.mkdir(parents=True, exist_ok=True)
        if self.fsync:
            fsync_dir(self._data)
            fsync_dir(self.root)

    def _recover(self) -> None:
        """Make disk agree with the index: drop entries without a complete
        file, remove files and temp files the index does not know. An index
        set aside as damaged, or empty beside data files (truncated), is
        rebuilt from the files that pass `check` (none without one)."""
        raw = self._db.entries
        entries = {BlockHash(k): _Entry(*_ENTRY.unpack(v)) for k, v in (raw or {}).items()}
        files = [f for f in os.scandir(self._data) if f.is_file(follow_symlinks=False)]
        rebuilt = raw is None or (not raw and any(parse_name(f.name) for f in files))
        kept = self._rebuild(files) if rebuilt else self._match(files, entries)
        if rebuilt:
            self._db.write({h: e.pack() for h, e in kept.items()}, [], dict)
            log.warning("disk tier %s: index rebuilt from %d of %d data files", self.root, len(kept), len(files))
        dropped = [h for h in entries if h not in kept]
        if dropped and not rebuilt:
            log.warning("disk tier %s: dropping %d index entries without a valid file", self.root, len(dropped))
            self._write_index({}, dropped)
        self._index = kept
        self._used = sum(e.size for e in kept.values())
        self._clock = max((e.atime for e in kept.values()), default=0)
        self.stats.add(blocks=len(kept), used_bytes=self._used, errors=self._db.healed)

    @staticmethod
    def _match(files: list[os.DirEntry], entries: dict[BlockHash, _Entry]) -> dict[BlockHash, _Entry]:
        """The entries whose file is there with its size; other files removed."""
        kept = {}
        for f in files:
            h = parse_name(f.name)
            e = entries.get(h) if h is not None else None
            if e is not None and f.stat().st_size == e.size:
                kept[h] = e
            else:
                unlink_quiet(f.path)
        return kept

    def _rebuild(self, files: list[os.DirEntry]) -> dict[BlockHash, _Entry]:
        """Entries for the data files that `check` finds whole; others removed."""
        kept = {}
        for f in files:
            h = parse_name(f.name)
            try:
                data = Path(f.path).read_bytes() if h is not None and self._check is not None else b""
            except OSError:
                data = b""
            if data and self._check(h, memoryview(data)):
                kept[h] = _Entry(len(data), xxhash.xxh3_64_intdigest(data), f.stat().st_mtime_ns)
            else:
                unlink_quiet(f.path)
        return kept

    def path_of(self, h: BlockHash) -> Path:
        """Where the data file of `h` lives (whether or not it exists)."""
        return self._data / h.hex()

    def put_many(self, hashes: Sequence[BlockHash], objs: Sequence[torch.Tensor]) -> list[bool]:
        todo = self._admit(hashes, objs)
        try:
            written = [self._write_temp(hashes[i], objs[i]) for i in todo]
            self._commit([w for w in written if w is not None])
        finally:
            with self._lock:
                self._reserved -= sum(objs[i].numel() for i in todo)
        return self.contains_many(hashes)

    def _write_temp(self, h: BlockHash, obj: torch.Tensor) -> tuple[BlockHash, Path, _Entry] | None:
        """Write `obj` durably under a temp name next to its final path; None
        if that fails (ENOSPC is a full disk, anything else is also an error)."""
        data = memoryview(obj.cpu().numpy())
        tmp = self.path_of(h).with_name(f"{_TMP_PREFIX}{h.hex()}-{os.getpid()}-{next(self._seq)}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = data
                while view:
                    view = view[os.write(fd, view):]
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            unlink_quiet(tmp)
            if e.errno == errno.ENOSPC:  # a capacity condition, not an error: say so, but not per block
                now = time.monotonic()
                if now - self._full_logged >= 10.0:
                    self._full_logged = now
                    log.warning("disk tier %s: filesystem full; writes dropped until space frees up", self.root)
            else:
                log.warning("disk tier %s: writing %s failed: %s", self.root, tmp, e)
                self.stats.add(errors=1)
            return None
        return h, tmp, _Entry(len(data), xxhash.xxh3_64_intdigest(data), 0)

    def _commit(self, written: list[tuple[BlockHash, Path, _Entry]]) -> None:
        """Rename temp files into place, then index them; on failure remove
        them all (a crash in between leaves orphans, which open removes)."""
        if not written:
            return
        with self._commit_lock:
            with self._lock:  # a racing put of the same hash may have won already
                fresh = [w for w in written if w[0] not in self._index]
            try:
                for h, tmp, _ in fresh:
                    os.rename(tmp, self.path_of(h))
                if self.fsync:
                    for d in {self.path_of(h).parent for h, _, _ in fresh}:
                        fsync_dir(d)
                with self._lock:
                    for _, _, e in fresh:
                        e.atime = self._tick()
                ok = self._write_index({h: e for h, _, e in fresh}, [])
            except OSError as e:
                log.warning("disk tier %s: publishing %d files failed: %s", self.root, len(fresh), e)
                ok = False
            finally:
                for _, tmp, _ in written:  # beaten by a racing put, or never renamed
                    unlink_quiet(tmp)
            if not ok:
                self.stats.add(errors=1)
                for h, _, _ in fresh:
                    unlink_quiet(self.path_of(h))
                return
            nbytes = sum(e.size for _, _, e in fresh)
            with self._lock:
                self._index.update((h, e) for h, _, e in fresh)
                self._used += nbytes
            self.stats.add(blocks=len(fresh), used_bytes=nbytes, bytes_in=nbytes)

    def delete_many(self, hashes: Iterable[BlockHash]) -> int:
        with self._commit_lock:
            with self._lock:
                self._check_open()
                gone = self._unindex({h for h in hashes if h in self._index})
            if not gone:
                return 0
            # Index first: a crash before the unlinks leaves orphans, which open removes.
            if not self._write_index({}, gone):
                self.stats.add(errors=1)
            for h in gone:
                unlink_quiet(self.path_of(h))
        return len(gone)

    def _unindex(self, hashes: Iterable[BlockHash]) -> list[BlockHash]:
        """Forget held blocks in memory (caller holds the lock); returns them."""
        gone = [(h, self._index.pop(h)) for h in hashes]
        self._dirty.difference_update(h for h, _ in gone)
        nbytes = sum(e.size for _, e in gone)
        self._used -= nbytes
        self.stats.add(blocks=-len(gone), used_bytes=-nbytes)
        return [h for h, _ in gone]

    def _write_index(self, puts: dict[BlockHash, _Entry], dels: list[BlockHash]) -> bool:
        """One lmdb write transaction: `puts`, `dels`, and every pending
        last-access update. Caller holds the commit lock (or is opening)."""
        with self._lock:
            touched = {h: self._index[h].pack() for h in self._dirty if h in self._index}
        ok = self._db.write({h: e.pack() for h, e in puts.items()} | touched, dels, self._mirror)
        if not ok:
            return False
        with self._lock:  # an access since the snapshot stays dirty
            self._dirty.difference_update(
                h for h, packed in touched.items() if h in self._index and self._index[h].pack() == packed)
        return True

    def _mirror(self) -> dict[bytes, bytes]:
        """Every held entry, packed: what a rebuilt index is written from."""
        with self._lock:
            return {h: e.pack() for h, e in self._index.items()}

    def get_many(self, hashes: Sequence[BlockHash]) -> list[torch.Tensor | None]:
        """Verified copies of the files; a damaged or missing file is a miss
        and is quarantined."""
        with self._lock:
            self._check_open()
            entries = [self._index.get(h) for h in hashes]
            for h, e in zip(hashes, entries):
                if e is not None:
                    e.atime = self._tick()
                    self._dirty.add(h)
        found = [(h, e) for h, e in zip(hashes, entries) if e is not None]
        bufs = buffers(self._arena, [e.size for _, e in found])
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
        return out

    def _read(self, h: BlockHash, e: _Entry, buf: torch.Tensor) -> torch.Tensor | None:
        """The file's bytes, read into `buf` (e.size bytes), if its size and
        checksum match `e`, else None."""
        view = memoryview(buf.numpy())
        try:
            with open(self.path_of(h), "rb", buffering=0) as f:
                if os.fstat(f.fileno()).st_size != e.size:
                    return None
                n = 0
                while n < e.size:
                    got = f.readinto(view[n:])
                    if not got:
                        return None
                    n += got
        except FileNotFoundError:
            return None
        except OSError as err:
            log.warning("disk tier %s: reading %s failed: %s", self.root, h.hex(), err)
            self.stats.add(errors=1)
            return None
        return buf if xxhash.xxh3_64_intdigest(view) == e.csum else None

    def recheck(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Read held files back; those that fail their checks are quarantined
        and returned (the caller writes them again)."""
        with self._lock:
            found = [(h, self._index[h]) for h in hashes if h in self._index]
        bad = []
        for h, e in found:
            if self._read(h, e, torch.empty(e.size, dtype=torch.uint8)) is None and self._set_aside(h, e):
                bad.append(h)
        self.stats.add(corrupt=len(bad))
        return bad

    def quarantine(self, hashes: Iterable[BlockHash]) -> None:
        """Move blocks that failed the store's checks into quarantine/. The
        store counts those; `stats.corrupt` counts this tier's own failures."""
        with self._lock:
            found = [(h, self._index[h]) for h in hashes if h in self._index]
        for h, e in found:
            self._set_aside(h, e)

    def _set_aside(self, h: BlockHash, e: _Entry) -> bool:
        """Unindex `h` and move its file to quarantine/, unless a delete or a
        re-put replaced entry `e` meanwhile (then it was a plain miss)."""
        with self._commit_lock:
            with self._lock:
                if self._closed or self._index.get(h) is not e:
                    return False
                self._unindex([h])
            log.warning("disk tier %s: block %s failed verification, quarantined", self.root, h.hex())
            if not self._write_index({}, [h]):
                self.stats.add(errors=1)
            with suppress(FileNotFoundError):
                os.rename(self.path_of(h), self._quarantine_dir / f"{h.hex()}-{os.getpid()}-{next(self._seq)}")
        return True

    def contains_many(self, hashes: Sequence[BlockHash]) -> list[bool]:
        with self._lock:
            return [h in self._index for h in hashes]

    def keys(self) -> list[BlockHash]:
        """Held hashes, least recently used (read or written) first."""
        with self._lock:
            return sorted(self._index, key=lambda h: self._index[h].atime)

    def close(self) -> None:
        """Flush last-access times, close the index and release the root."""
        with self._commit_lock:
            if self._closed:
                return
            if self._dirty:
                self._write_index({}, [])
            with self._lock:
                self._closed = True
            self._db.close()
            os.close(self._lock_fd)

    def _tick(self) -> int:
        """A strictly increasing wall-clock timestamp (caller holds the lock)."""
        self._clock = max(time.time_ns(), self._clock + 1)
        return self._clock

    def _check_open(self) -> None:
        if self._closed:
            raise TierKVError(f"disk tier {self.root} is closed")
