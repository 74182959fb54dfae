"""The disk tier's records (tiers/disk.py): what it knows of the blocks in
its slots, and how that knowledge opens, heals, merges and recovers.

Four parts: the lmdb index, the truth once merged (tiers/disk_index.py);
the fresh records of the latest puts, not merged yet (tiers/disk_fresh.py);
the access times reads gave since the last index write
(tiers/disk_recency.py); the presence table that answers lookups once the
sweep has filled it (tiers/presence.py). `DiskTier` builds its puts, reads
and deletes on this base; the locks and the slot side (segments, free
slots) are its own, declared here for the methods that use them.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable, Sequence, TypeVar

import lmdb
import numpy as np

from tiers.base import TierStats
from tiers.disk_fresh import MERGE_TXN, FreshRecords
from tiers.disk_index import RECORD, DiskIndex
from tiers.disk_recency import EXACT_LRU, AccessTimes
from tiers.disk_slots import Check, Segments
from tiers.disk_space import FreeSlots
from tiers.presence import PresenceTable, read_where
from tiers.types import BlockHash, TierKVError

log = logging.getLogger("tiers.disk")

Entry = tuple[int, int, int, int]  # an unpacked index record: size, checksum, slot, last access
T = TypeVar("T")


class DiskRecords:
    """The record side of `DiskTier` (module docstring); thread-safe under
    the tier's locks: `_lock` guards the counters and the presence table,
    `commit_lock` serializes index writes, merges, heals and slot frees."""

    root: Path
    stats: TierStats
    index: DiskIndex
    segments: Segments
    space: FreeSlots
    closed: bool
    recovering: bool  # the index was dirty at open: the sweep reads the slots no record names
    presence_ready: bool
    commit_lock: threading.RLock
    _lock: threading.Lock
    _check: Check | None
    _fresh: FreshRecords
    _atimes: AccessTimes
    _presence: PresenceTable
    _dirty: bool  # this tier set the index's dirty flag (a clean close clears it)
    _used: int
    _blocks: int

    def _open_index(self) -> None:
        """Totals and slot marks from the meta record; an index that is empty
        beside segment data (new, set aside, truncated) is rebuilt from it,
        one without a sound meta record recounted."""
        try:
            records, (blocks, _), dirty = self.index.records(), self.index.totals(), self.index.dirty()
            if records == 0 and not dirty and any(self.segments.ends().values()):
                self._heal(self.index.generation, None, True)  # new, set aside or emptied beside segment data
            else:
                if blocks != records:
                    log.warning("disk tier %s: index totals disagree with its %d records; recounting",
                                self.root, records)
                    self.index.recount()
                self.recovering = dirty  # slots past the marks may hold blocks: none handed out
                self.stats.add(recovering=int(dirty))
                self.space = FreeSlots(self.segments.held(self.index.marks()) if self.recovering else self.index.marks())
        except lmdb.Error as e:
            self._heal(self.index.generation, str(e), True)
        self._sync_totals()
        self.stats.add(errors=self.index.healed)

    def _heal(self, generation: int, problem: str | None, opening: bool = False) -> None:
        """Replace the index (damaged as of `generation`; None: empty) with
        one rebuilt from the slots whose objects `check` finds whole; the
        others are cleared (`opening`: no put is in flight)."""
        with self.commit_lock, self._writes.quiet():  # no put writes a slot while every slot is read
            self._check_open()
            if self.index.generation != generation:
                return  # another thread healed it meanwhile
            kept, used = self.segments.records(self._check, self._atimes.tick())
            marks = {c: max(slots) + 1 for c, slots in used.items()}
            # at open, every slot of the files is known free or used: none is lost to the free lists (an
            # emptied tier's slots past its last block would hold their space untracked)
            marks = self.space.rebuilt(self.segments.held(marks) if opening else marks, used, opening)
            self.segments.sync(set(self.segments.ends()))  # slots found in the page cache: durable before indexed
            self.index.replace(problem, kept, marks)
            self._atimes.take()
            self._fresh.clear()  # their slots were read: indexed now
            self._dirty = False
            self._recovered()
            with self._lock:
                self._presence, self.presence_ready = PresenceTable(len(kept)), True
                self._presence.add(list(kept))
            log.warning("disk tier %s: index rebuilt from %d whole objects in its segments", self.root, len(kept))
            self._sync_totals()
        if problem is not None and not opening:  # those at open are counted there, with the ones vet found
            self.stats.add(errors=1)

    def _sync_totals(self) -> None:
        """Take the counters from the index's totals and the fresh records' (after each write)."""
        (blocks, used), (fresh, fresh_bytes) = self.index.totals(), self._fresh.totals()
        blocks, used = blocks + fresh, used + fresh_bytes
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
        """The index record of each hash (None: not held): fresh ones first,
        as a merge drops them only once lmdb has them."""
        fresh = self._fresh.get_many(hashes)
        ask = [h for h, v in zip(hashes, fresh) if v is None]
        raw = iter(self._reading(lambda index: index.get_many(ask)) if ask else ())
        return [RECORD.unpack(v) if (v := f if f is not None else next(raw)) is not None else None for f in fresh]

    def merge(self) -> bool:
        """Write the fresh records into lmdb, `MERGE_TXN` per transaction (a
        full map keeps the rest fresh, counted as an error)."""
        with self.commit_lock:
            if self.closed:
                return True
            recs = self._fresh.batch()
            # in key order: lmdb walks its tree in order, 2.5-3x faster than the order put, pages as full (#19)
            keys = sorted(recs)
            for a in range(0, len(keys), MERGE_TXN):
                if not self._write_index({h: recs[h] for h in keys[a:a + MERGE_TXN]}, [], self._fresh.marks,
                                         present=False):
                    self._fresh.merged({h: recs[h] for h in keys[:a]})
                    self.stats.add(errors=1)
                    return False
            self._fresh.merged(recs)  # once all committed: readers find each one fresh or in lmdb
            self._sync_totals()
            return True

    def _present(self, hashes: Sequence[BlockHash]) -> list[bool]:
        return self._maybe_read(hashes, self._held, False)

    def _held(self, hashes: list[BlockHash]) -> list[bool]:
        """Whether a record names each hash: fresh, or else in lmdb (asked only about the others)."""
        fresh = [v is None for v in self._fresh.get_many(hashes)]
        return read_where(fresh, hashes, lambda hs: self._reading(lambda index: index.has_many(hs)), True)

    def _maybe_read(self, hashes: Sequence[BlockHash], read: Callable[[list[BlockHash]], list[T]],
                    default: T) -> list[T]:
        """`read` of the hashes the presence table, once filled, says may be
        held; `default` for the others (a put's new blocks cost no index read)."""
        with self._lock:
            maybe = self._presence.contains(hashes) if self.presence_ready else None
        return read_where(maybe, hashes, read, default)

    def _unindex(self, hashes: list[BlockHash]) -> bool:
        """Remove the records of `hashes`, fresh or in lmdb (caller holds the
        commit lock). False: lmdb refused, and none was removed (the caller
        keeps their slots)."""
        fresh = [h for h, v in zip(hashes, self._fresh.get_many(hashes)) if v is not None]
        known = set(fresh)
        rest = [h for h in hashes if h not in known]
        generation = self.index.generation
        if rest and not self._write_index({}, rest):
            return False
        if fresh and self.index.generation != generation and not self._write_index({}, fresh):
            return False  # a heal meanwhile indexed the fresh ones from their slots: they go from lmdb too
        self._fresh.pop(fresh)
        with self._lock:
            self._presence.discard(fresh)
        self._sync_totals()
        return True

    def _write_index(self, puts: dict[BlockHash, bytes], dels: list[BlockHash],
                     marks: dict[int, int] | None = None, dirty: bool | None = None, present: bool = True) -> bool:
        """One index write transaction (caller holds the commit lock): `puts`,
        `dels`, the slot `marks`, the `dirty` flag and the access times gathered
        since the last one; a damaged index is healed and the write applied
        to the new one. `present`: the puts are not in the presence table yet.
        The caller syncs the totals (`_sync_totals`) when its change is whole."""
        pending = self._atimes.take()
        generation = self.index.generation
        try:
            ok = self.index.write(puts, dels, pending, marks, dirty)
        except lmdb.Error as e:
            self._heal(generation, str(e))
            ok = self.index.write(puts, dels, None, dict(self.space.marks), dirty)
        if ok:
            with self._lock:
                if present:
                    self._presence.add(list(puts))
                self._presence.discard(dels)
        return ok  # the caller syncs the totals once its fresh records agree (a merge drops its part after)

    def contains_many(self, hashes: Sequence[BlockHash]) -> list[bool]:
        with self._lock:  # the presence table once the sweep has filled it (tiers/presence.py)
            if self.presence_ready:
                return self._presence.contains(hashes)
        return self._present(hashes)

    def learn(self, after: bytes) -> list[tuple[bytes, bytes]]:
        """The sweep's walk: the next records past `after`, added to the
        presence table and their slots marked in use (under the commit
        lock, so no write slips between)."""
        with self.commit_lock:
            chunk = self._scan(after)
            self.space.seen([v for _, v in chunk])
            with self._lock:
                self._presence.add([k for k, _ in chunk])
                self.presence_ready = self.presence_ready or not chunk
        return chunk

    def recover(self, holes: dict[int, np.ndarray]) -> int:
        """The sweep's end after a dirty open: index the whole blocks in
        `holes` (slots per slot size no record names) that no record names
        elsewhere; how many. Their slots are marked in use as they are
        indexed (a delete before the walk's end frees them again)."""
        n, failed = 0, False
        refused, self._refused = self._refused, []  # what an earlier try found and the index refused
        batches = [refused[a:a + 4096] for a in range(0, len(refused), 4096)]
        batches += [(c, slots[a:a + 4096]) for c, slots in holes.items() for a in range(0, len(slots), 4096)]
        for batch in batches:
            found = batch if isinstance(batch, list) else self.segments.found(batch[0], batch[1].tolist(), self._check)
            with self.commit_lock:
                self._check_open()
                if not self.recovering:  # a heal meanwhile rebuilt the index from every slot
                    return n
                ok, k = self._recover_some(found)
                n, failed = n + k, failed or not ok
                if not ok:
                    self._refused += found  # their slots are kept from reuse: the next try indexes them
        log.info("disk tier %s: %d blocks written before an unclean stop indexed again", self.root, n)
        if not failed:  # else the flag stays: the next open looks again
            self._dirty = True  # a clean close clears the flag
            self._recovered()
        return n

    def _recover_some(self, found: list[tuple[BlockHash, int, int, int]]) -> tuple[bool, int]:
        """Index those of `found` (whole blocks in their slots) no record
        names, the first copy of each, as many as fit the capacity, and mark their slots in use (caller
        holds the commit lock): (False if the index refused them, their
        slots kept from reuse all the same; how many)."""
        held, firsts = self.records_of([f[0] for f in found]), {}
        with self._lock:  # puts since the open count first: what no longer fits is let go (puts still
            room = self.capacity_bytes - self._used  # under way are not counted: one that fails frees nothing)
        for f, e in zip(found, held):
            if e is None and f[0] in self._deleted_early:  # deleted while the walk was on its way: it stays so
                self._clear(f[1], f[3])
            elif e is None and f[0] not in firsts and f[1] <= room:
                firsts[f[0]] = f
                room -= f[1]
            elif e is None or (e[0], e[2]) != (f[1], f[3]):  # another copy stands (a record on this slot: this copy)
                self._clear(f[1], f[3])
        recs = {h: RECORD.pack(size, csum, s, t) for (h, size, csum, s), t in
                zip(firsts.values(), self._atimes.ticks(len(firsts)))}
        if recs:  # slots a stop may have left unsynced (found in the page cache): durable before indexed
            self.segments.sync(set(self.segments.ends()))
        # the marks too: they are past these slots only in memory (raised to the files' ends at open)
        ok = not recs or self._write_index(recs, [], dict(self.space.marks))
        if not ok:
            self.stats.add(errors=1)
        self._sync_totals()
        self.space.seen(list(recs.values()))
        return ok, len(recs)

    def _clear(self, size: int, s: int) -> None:
        """Zero a slot's header (a freed or second copy); a failure is logged: the slot stays as it is."""
        try:
            self.segments.clear(size, s)
        except OSError as err:
            log.warning("disk tier %s: clearing a freed slot failed: %s", self.root, err)

    def _recovered(self) -> None:
        if self.recovering:
            self._deleted_early.clear()
            self.recovering = False
            self.stats.add(recovering=-1)

    def keys(self) -> list[BlockHash]:
        """Held hashes, least recently used (read or written) first (reads every record)."""
        self.merge()
        return [h for h, _ in sorted(self._atimes.every(self._scan), key=lambda r: r[1])]

    def oldest(self, n: int, draws: int, skip: Callable[[BlockHash], bool] = lambda h: False) -> list[BlockHash]:
        if len(self._fresh) and (self._blocks <= EXACT_LRU or 2 * len(self._fresh) > self._blocks):
            self.merge()  # the candidates are lmdb's records: most of them not fresh
        return self._atimes.oldest(n, draws, skip, self._blocks, self._scan,
                                   lambda draw: self._reading(lambda index: index.sample(draw)))

    def _scan(self, after: bytes) -> list[tuple[bytes, bytes]]:
        return self._reading(lambda index: index.scan(after))

    def _check_open(self) -> None:
        if self.closed:
            raise TierKVError(f"disk tier {self.root} is closed")
