"""Local NVMe tier: block objects in slots of segment files, an lmdb index as the truth.

Layout under `root`:

    segments/<slot size>-<n>  segment files of fixed-size slots (tiers/disk_slots.py)
    quarantine/               objects that failed verification, kept for forensics
    index.lmdb/               hash -> (object size, xxh3_64 of it, slot, last access ns)
    LOCK                      flock held by the one process that owns the tier

Crash safety: a put writes its objects into free slots and fdatasyncs the
segment files (one C call) before their records exist; the records are
fresh, in memory, until merged into lmdb many at a time, and the index
carries a dirty flag meanwhile (tiers/disk_fresh.py), so after any crash
every indexed slot is complete, and the slots written since the last merge
are read and indexed again by the sweep after a dirty open (what a slot
holds names its block, size and checksum). A delete unindexes first and
frees the slot after. Reads check the slot's header, size and checksum against the index
anyway (bit rot, outside writers, an undone delete whose slot was reused):
a mismatch is a miss and the object is quarantined. A damaged index heals
(tiers/disk_index.py): it is set aside and rebuilt from the slots whose
objects the owner's `check` finds whole (the store passes one that reads
each object's own header and checksum), so one damaged slot never leaves
the engine without its cache; a missing LOCK file is simply created again.

The record side (index, fresh records, access times, presence table; how
they open, heal, merge and recover) is `DiskRecords` (tiers/disk_records.py).

At scale: opening reads the index's meta record (totals, slot marks), not
every entry. Access times given by reads reach lmdb with the next write
(tiers/disk_recency.py), where `oldest` finds eviction candidates. The
sweep after opening (tiers/disk_sweep.py) fills a presence table of 8 bytes
per block that answers lookups (tiers/presence.py), finds the slots deletes
left free, and quarantines records whose slot is gone. A directory of the
earlier one-file-per-block layout (`data/`) is set aside and removed.
"""
from __future__ import annotations

import logging
import os
import threading
from itertools import count
from pathlib import Path
from typing import Iterable, Sequence

import torch

from tiers.arena import Arena
from tiers.base import ByteBudget, Tier
from tiers.disk_fresh import MERGE_TXN, FreshRecords
from tiers.disk_index import RECORD, DiskIndex
from tiers.disk_io import WriteErrors, buffers, fsync_dir, lock_root, readers, set_aside_old_layout
from tiers.disk_records import DiskRecords, Entry
from tiers.disk_recency import AccessTimes
from tiers.disk_geometry import slot_size
from tiers.disk_slots import Check, Segments
from tiers.disk_space import FreeSlots, WritesInFlight
from tiers.disk_sweep import sweep
from tiers.presence import PresenceTable
from tiers.types import HASH_BYTES, BlockHash, TierUnavailableError

log = logging.getLogger(__name__)

Written = tuple[BlockHash, int, int, int]  # a put's object in its slot: hash, size, checksum, slot


class DiskTier(DiskRecords, ByteBudget, Tier):
    """Block objects as checksummed slots of segment files under `root`,
    indexed by lmdb.

    `fsync` False skips every fsync (tests, throwaway caches): the tier stays
    consistent across process crashes but not across power loss. `map_size`
    bounds the lmdb index (a sparse mapping; 16 GiB indexes ~100M blocks).
    """

    name = "disk"
    verify_payload = False  # sizes and checksums are verified on every read
    rechecks = True  # slots can be damaged under the tier
    keeps_recency = True

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, fsync: bool = True,
                 map_size: int = 1 << 34, check: Check | None = None) -> None:
        super().__init__(capacity_bytes)
        self.root = Path(root)
        self.fsync = fsync
        self._check = check
        self._quarantine_dir = self.root / "quarantine"
        new = not (self.root / "segments").is_dir()
        self._quarantine_dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = lock_root(self.root)
        try:
            set_aside_old_layout(self.root)
            self.segments = Segments(self.root / "segments", fsync, capacity_bytes // 8)  # per slot size
            if fsync and new:
                fsync_dir(self.root)
            self.index = DiskIndex(self.root / "index.lmdb", map_size, fsync, HASH_BYTES, RECORD.size)
        except (TierUnavailableError, OSError):
            os.close(self._lock_fd)
            raise
        self._lock = threading.Lock()  # guards the counters, reservations and the presence table
        self.commit_lock = threading.RLock()  # serializes index writes, slot frees, heals
        self._atimes = AccessTimes()  # given by reads, until the next index write (tiers/disk_recency.py)
        self._used = self._blocks = self._reserved = 0
        self._fresh = FreshRecords()  # the latest puts' records, merged into lmdb many at a time (tiers/disk_fresh.py)
        self._dirty = False  # whether this tier set the index's dirty flag (cleared at a clean close)
        self.recovering = False  # dirty at open: the sweep reads the slots no record names (tiers/disk_sweep.py)
        self._deleted_early: set[BlockHash] = set()  # deletes while recovering: the sweep does not index those
        self._refused: list = []  # blocks the recovery found and the index refused, for its next try
        self._seq = count()
        self._arena = Arena()  # read buffers, reused once callers drop what they got
        self._write_errors = WriteErrors(self.root)
        self.closed = False
        self._presence, self.presence_ready = PresenceTable(self.index.size_hint()), False  # filled by the sweep
        self.space = FreeSlots({})
        self._writes = WritesInFlight()  # a put's slot writes, which a close or a heal's scan waits out
        try:
            self._open_index()
        except Exception:  # a heal that failed: nothing of this tier stays open (the root's lock included)
            self.index.close()
            self.segments.close()
            os.close(self._lock_fd)
            raise
        self.swept = threading.Event()
        self._sweeper = threading.Thread(target=sweep, args=(self,), name="tierkv-disk-sweep", daemon=True)
        self._sweeper.start()

    def location_of(self, h: BlockHash) -> tuple[Path, int, int] | None:
        """(segment file, offset, size) of block `h`'s object bytes, if held."""
        e = self.records_of([h])[0]
        return None if e is None else (*self.segments.located(e[0], e[2]), e[0])

    def files(self) -> list[Path]:
        """The segment files (to drop from the page cache, say)."""
        return [self.segments.path(key) for key in self.segments.ends()]

    def put_many(self, hashes: Sequence[BlockHash], objs: Sequence[torch.Tensor]) -> list[bool]:
        sizes = [obj.numel() for obj in objs]  # once: a torch call per block costs more than most steps here
        todo = self._admit(hashes, objs, sizes)
        try:
            with self._writes.writing():  # a close waits for these writes (it closes their files)
                self._check_open()
                written = self._write_slots([hashes[i] for i in todo], [objs[i] for i in todo],
                                            [sizes[i] for i in todo])
            self._commit(written)
        finally:
            with self._lock:
                self._reserved -= sum(sizes[i] for i in todo)
        self.reclaim()  # less room: free slots of other sizes may now be more than it can fill
        return self.contains_many(hashes)

    def reclaim(self) -> None:
        """Free slots' space past the room left goes back (`FreeSlots.reclaim`); not once closed
        (a close waits for this: it closes the files punched)."""
        with self._lock:  # a put's reservation is not room taken until its slots are (its own reclaim follows)
            room = self.capacity_bytes - self._used
        with self._writes.writing():
            if not self.closed:
                self.space.reclaim(self.segments, self.segments.step, room)

    def _write_slots(self, hashes: list[BlockHash], objs: list[torch.Tensor], sizes: list[int]) -> list[Written]:
        """Write the objects (of `sizes` bytes) into free slots and make them
        durable: (hash, size, checksum, slot) of each written; a slot that
        failed (ENOSPC is a full disk, anything else an error) is free again."""
        objs = [o if o.is_cpu else o.cpu() for o in objs]
        written, _, err = self.space.write_into(self.segments, hashes, objs, sizes, durable=True)
        if err is not None:
            self._write_failed(err)
        return written

    def _write_failed(self, e: OSError) -> None:
        self.stats.add(errors=self._write_errors.report(e))

    def _free(self, written: Iterable[Written]) -> None:
        for _, size, csum, s in written:
            self._release((size, csum, s, 0))

    def _commit(self, written: list[Written]) -> None:
        """Index the written slots (a crash before leaves them free); those
        a racing put of the same hash beat are freed again."""
        if not written:
            return
        with self.commit_lock:
            self._check_open()  # a put that lost a race with close(): its slots stay unindexed, free at the next open
            held = self._maybe_read([w[0] for w in written], self.records_of, None)
            fresh = [w for w, e in zip(written, held) if e is None]
            # beaten by a racing put (or indexed by a heal that found this very slot: kept)
            self._free(w for w, e in zip(written, held) if e is not None and e[2] != w[3])
            pack = RECORD.pack
            puts = {h: pack(size, csum, s, t) for (h, size, csum, s), t in zip(fresh, self._atimes.ticks(len(fresh)))}
            if not self._dirty:  # durable before the first record that lives only in memory (meta page too)
                self._dirty = self._write_index({}, [], dirty=True)
                if self._dirty:
                    self.index.sync()
            if not self._dirty:
                self.stats.add(errors=1)
                self._free(fresh)
                return
            nbytes = sum(w[1] for w in fresh)
            self._fresh.add(puts, nbytes, dict(self.space.marks))
            with self._lock:
                self._presence.add(list(puts))
            if self._fresh.due():
                self.merge()
            self._sync_totals()
        self.stats.add(bytes_in=nbytes)

    def delete_many(self, hashes: Iterable[BlockHash]) -> int:
        hashes = list(dict.fromkeys(hashes))
        with self.commit_lock:
            gone = [(h, e) for h, e in zip(hashes, self.records_of(hashes)) if e is not None]
            if self.recovering:  # a block written before the unclean stop may have no record yet
                known = {h for h, _ in gone}
                self._deleted_early.update(h for h in hashes if h not in known)
            if not gone:
                return 0
            # Index first: the slots are free only once no record names them.
            if not self._unindex([h for h, _ in gone]):
                self.stats.add(errors=1)
                return 0
            for _, e in gone:
                self._release(e)
        self.reclaim()  # past the lock: puts commit meanwhile
        return len(gone)

    def _release(self, e: Entry) -> None:
        """Free the slot of unindexed record `e` (header cleared: a rebuild does not bring it back)."""
        self._clear(e[0], e[2])
        self.space.give(e[0], e[2])

    def get_many(self, hashes: Sequence[BlockHash]) -> list[torch.Tensor | None]:
        """Verified copies of the objects; a damaged or missing one is a miss
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
        """The object's bytes, read into `buf` (e[0] bytes), if its slot's
        header, size and checksum match record `e`, else None."""
        try:
            return buf if self.segments.read(h, e[0], e[1], e[2], buf) else None
        except OSError as err:
            log.warning("disk tier %s: reading %s failed: %s", self.root, h.hex(), err)
            self.stats.add(errors=1)
            return None

    def recheck(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Read held objects back; returns those not held sound any more, for
        the caller to write again: each that fails its checks is quarantined
        here, or was by another thread (the sweep) since the caller saw it
        held, which this tier's own count of failures leaves out."""
        failed = [(h, e) for h, e in zip(hashes, self.records_of(hashes))
                  if e is None or self._read(h, e, torch.empty(e[0], dtype=torch.uint8)) is None]
        mine = {h for h, e in failed if e is not None and self._set_aside(h, e)}
        self.stats.add(corrupt=len(mine))
        others = [h for h, _ in failed if h not in mine]
        gone = {h for h, e in zip(others, self.records_of(others)) if e is None}  # else re-put meanwhile: held
        return [h for h, _ in failed if h in mine or h in gone]

    def quarantine(self, hashes: Iterable[BlockHash]) -> None:
        """Move blocks that failed the store's checks into quarantine/. The
        store counts those; `stats.corrupt` counts this tier's own failures."""
        hashes = list(hashes)
        for h, e in zip(hashes, self.records_of(hashes)):
            if e is not None:
                self._set_aside(h, e, force=True)

    def _set_aside(self, h: BlockHash, e: Entry, force: bool = False) -> bool:
        """Unindex `h`, copy its slot's bytes to quarantine/ and free the slot,
        unless record `e` was deleted or replaced meanwhile, or (unless
        `force`) the object now reads sound: then a reader raced a delete or
        a re-put, a plain miss."""
        with self.commit_lock:
            if self.closed:
                return False
            now = self.records_of([h])[0]
            if now is None or now[:3] != e[:3]:
                return False
            if not force and self._read(h, now, torch.empty(now[0], dtype=torch.uint8)) is not None:
                return False
            log.warning("disk tier %s: block %s failed verification, quarantined", self.root, h.hex())
            mine = self._owns_slot(h, e)
            if not self._unindex([h]):  # still indexed: a miss at each read until lmdb takes the delete
                self.stats.add(errors=1)
                return False
            if self._past_marks(e):  # a damaged size: the totals took it off
                log.warning("disk tier %s: a damaged index record; recounting the index's totals", self.root)
                self.index.recount()
                self._sync_totals()
            if mine:
                self.segments.keep(e[0], e[2], self._quarantine_dir / f"{h.hex()}-{os.getpid()}-{next(self._seq)}")
                self._release(e)
        return True

    def _past_marks(self, e: Entry) -> bool:
        """Whether record `e` names a slot past its size's marks (no put ever had it: a damaged record)."""
        return e[2] >= self.space.marks.get(slot_size(e[0]), 0)

    def _owns_slot(self, h: BlockHash, e: Entry) -> bool:
        """Whether record `e`'s slot is its block's to free: below the slot
        marks (past them, the marks hand it out) and not another block's by
        that block's own record (a damaged record may name a live block's
        slot; caller holds the commit lock)."""
        if self._past_marks(e):
            return False
        c = slot_size(e[0])
        try:
            other = self.segments.named(e[0], e[2])
        except OSError:
            return False
        if other in (h, None):
            return True
        theirs = self.records_of([other])[0]
        return theirs is None or (slot_size(theirs[0]), theirs[2]) != (c, e[2])

    def close(self) -> None:
        """Wait out slot writes under way, flush last-access times, stop the
        sweep, close the index and release the root."""
        with self._writes.quiet(), self.commit_lock:
            if self.closed:
                return
            if self._atimes.waiting() or self._dirty or len(self._fresh):  # a clean close: every record merged
                if len(self._fresh) > MERGE_TXN:  # in transactions of MERGE_TXN: one holds its pages in memory
                    self.merge()
                batch = self._fresh.batch()
                marks = self._fresh.marks if batch else None
                if self._write_index(batch, [], marks, None if self.recovering else False, False):
                    self._fresh.merged(batch)
            self.closed = True
        self._sweeper.join()
        with self.commit_lock:
            self.index.close()
            self.segments.close()
            os.close(self._lock_fd)
