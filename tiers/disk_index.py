"""The disk tier's lmdb index (tiers/disk.py), and how it heals.

The index is the only record of what the tier holds: nothing is read into
memory at open (millions of records open in O(1)); reads are lmdb lookups,
and a meta record (`META_KEY`, not a hash's length) keeps the counts the
tier needs at once (blocks, bytes, the last access time given out).

A damaged index must not take the cache down with it, nor the process: lmdb
maps the file, so a data.mdb shorter than its meta page says is a SIGBUS at
the first read past the end, and random bytes in a page surface as
MDB_CORRUPTED from any later cursor or write. So:

- before mapping it, the file is checked against lmdb's meta pages (magic,
  version, page size, last page in use <= the file's length), then extended
  (sparse: no disk space) 4 GiB past its last page in use: lmdb bounds page
  numbers but not a damaged record's length (up to 4 GiB), so a read past
  the file's end would be a SIGBUS; within the extension it reads zeros;
- records are read as views and each must have the owner's key and value
  lengths before it is copied (a damaged length is damage, not an allocation);
- damage met at open (the meta pages, the meta record) or by any later read
  or write (a page first touched then) moves the index aside
  (``index.lmdb.damaged-<ns>``, the last one kept for forensics) and opens a
  fresh one, filled from what the owner finds in its data (tiers/disk_slots.py `scan`).
  The old environment is left mapped, not closed: a reader in another
  thread may still be in it.

Each heal is logged once and counted in `healed`.

Durability: lmdb flushes a commit's pages but not its meta page (metasync
off): one fsync per commit instead of two, and a power cut can undo the
last commit only, leaving a consistent index. An undone put leaves slots
no record names (free again: past the slot marks of the last commit, or
found free by the sweep); an undone delete leaves a record on a slot that
may be written again (its header and checksum then disagree: a miss,
quarantined by the first read).
"""
from __future__ import annotations

import logging
import os
import shutil
import struct
import time
from pathlib import Path
from typing import Callable, Iterator

import lmdb

from tiers.types import TierUnavailableError

log = logging.getLogger(__name__)

# lmdb 0.9 meta page (two of them, pages 0 and 1): a 16-byte page header, then
# magic u32 @16, version u32 @20, the free DB's md_pad (the page size) u32 @40,
# last page in use u64 @136, transaction id u64 @144
_META = struct.Struct("<I")
_META_MAGIC, _DATA_VERSION = 0xBEEFC0DE, 1
_DAMAGED = "damaged-"
# what lmdb raises for an index it cannot trust (its other errors in a write are a failed write)
DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.PanicError, lmdb.BadChecksumError,
          lmdb.VersionMismatchError, lmdb.InvalidError, lmdb.IncompatibleError)
_LONGEST_RECORD = (1 << 32) + (1 << 20)  # what a damaged 32-bit record length can reach past its page

META_KEY = b"tierkv:meta"  # (records, bytes, then slot marks): not a hash's length, so never a block's key
DIRTY_KEY = b"tierkv:dirty"  # present while slots may hold blocks no record names yet (tiers/disk_fresh.py)
_TOTALS = struct.Struct("<QQ")
_MARK = struct.Struct("<QQ")  # slot size, slots handed out (tiers/disk_space.py)
# a hash's record: object size, xxh3_64 of its bytes, its slot (tiers/disk_slots.py), last access (ns since epoch)
RECORD = struct.Struct("<QQQQ")
MAX_OBJECT = 1 << 32  # bytes: larger than any block's object (a record saying more is damaged)
_PLACE = 24  # a record's bytes that say where and what the object is (all but the access time)


def walk(scan: Callable[[bytes], list[tuple[bytes, bytes]]]) -> Iterator[list[tuple[bytes, bytes]]]:
    """Every record, chunk by chunk, from `scan` (records past a key, in key order)."""
    after = b""
    while chunk := scan(after):
        yield chunk
        after = chunk[-1][0]


def record_size(record: bytes) -> int:
    """A record's object size (RECORD's first field; its checksum follows)."""
    return int.from_bytes(record[:8], "little")


def _meta_record(totals: tuple[int, int], marks: dict[int, int]) -> bytes:
    return _TOTALS.pack(*totals) + b"".join(_MARK.pack(c, m) for c, m in sorted(marks.items()))


def _parse_meta(meta: bytes | None) -> tuple[tuple[int, int], dict[int, int]]:
    if meta is None or len(meta) < _TOTALS.size or (len(meta) - _TOTALS.size) % _MARK.size:
        return (0, 0), {}
    marks = dict(_MARK.iter_unpack(meta[_TOTALS.size:]))
    return _TOTALS.unpack_from(meta), marks


def vet(path: Path) -> str | None:
    """What is wrong with the index environment at `path` as lmdb would map
    it, or None (sound, or new). Reads only the two meta pages; a sound
    file is extended past its last page in use (see the module docstring)."""
    f = path / "data.mdb"
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(2 * 65536)
    except FileNotFoundError:
        return None
    if size == 0:
        return None  # never written: lmdb initialises it
    metas = [m for m in (_meta(head, 0), _meta(head, 1)) if m is not None]
    if not metas:
        return "no valid meta page"
    psize, last, _ = max(metas, key=lambda m: m[2])
    if (last + 1) * psize > size:
        return f"file is {size} bytes, its meta page needs {(last + 1) * psize}"
    if size < (last + 1) * psize + _LONGEST_RECORD:
        os.truncate(f, (last + 1) * psize + _LONGEST_RECORD)
    return None


def bytes_in_use(path: Path) -> int:
    """How much of the index file at `path` lmdb uses (its sound meta page's
    last page), or the file's length when no meta page is sound."""
    f = path / "data.mdb"
    with open(f, "rb") as fh:
        head = fh.read(2 * 65536)
    metas = [m for m in (_meta(head, 0), _meta(head, 1)) if m is not None]
    if not metas:
        return f.stat().st_size
    psize, last, _ = max(metas, key=lambda m: m[2])
    return (last + 1) * psize


def _meta(head: bytes, which: int) -> tuple[int, int, int] | None:
    """(page size, last page, txn id) of meta page `which`, if it is one."""
    psize = _META.unpack_from(head, 40)[0] if len(head) >= 48 else 0
    if psize < 512 or psize > 65536 or psize & (psize - 1):
        return None
    off = which * psize
    if len(head) < off + 152:
        return None
    magic, version = struct.unpack_from("<II", head, off + 16)
    if magic != _META_MAGIC or version != _DATA_VERSION or _META.unpack_from(head, off + 40)[0] != psize:
        return None
    last, txnid = struct.unpack_from("<QQ", head, off + 136)
    return psize, last, txnid


class DiskIndex:
    """hash -> packed record in lmdb at `path`, plus one meta record; see
    the module docstring. Every hash record has `key_len` and `value_len`
    bytes. Reads and writes raise lmdb.Error on damage: the owner then
    `replace`s the index (it alone knows what to fill it with)."""

    def __init__(self, path: Path, map_size: int, sync: bool, key_len: int, value_len: int) -> None:
        self.path, self._sync, self._lens = path, sync, (key_len, value_len)
        self._map_size = max(map_size, 2 * _LONGEST_RECORD)  # the extension is mapped too
        self.healed = 0
        self.generation = 0  # bumped by each `replace`
        self._old: list[lmdb.Environment] = []  # set aside, still mapped for readers in them
        problem = vet(path)
        if problem is None:
            try:
                self._env = self._open()
                return
            except TierUnavailableError as e:
                problem = str(e.__cause__ or e)
        self._set_aside(problem)
        self._env = self._open()

    def _open(self) -> lmdb.Environment:
        try:
            return lmdb.open(str(self.path), map_size=self._map_size, subdir=True, sync=self._sync,
                             metasync=False, readahead=False, max_dbs=0)
        except lmdb.Error as e:
            raise TierUnavailableError(f"disk index {self.path}: cannot open: {e}") from e

    def _record(self, k: bytes, v: bytes | None) -> bytes | None:
        if v is not None and (len(k), len(v)) != self._lens:
            raise lmdb.CorruptedError(f"a record of {len(k)}+{len(v)} bytes, not {self._lens}")
        if v is not None and record_size(v) > MAX_OBJECT:  # damaged bytes in range: read as a size, an allocation
            raise lmdb.CorruptedError(f"a record of a {record_size(v)}-byte object")
        return v

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """The record of each key (None: not held), in one read transaction."""
        with self._env.begin() as txn:
            return [self._record(k, txn.get(k)) for k in keys]

    def has_many(self, keys: list[bytes]) -> list[bool]:
        """Whether each key has a record (lookups: nothing copied or checked)."""
        with self._env.begin() as txn:
            get = txn.get
            return [get(k) is not None for k in keys]

    def meta(self) -> bytes | None:
        """The meta record, if one was written."""
        with self._env.begin() as txn:
            return txn.get(META_KEY)

    def size_hint(self) -> int:
        """About how many records the index holds, from its meta page alone
        (safe on a damaged tree)."""
        return self._env.stat()["entries"]

    def records(self) -> int:
        """How many hash records the index holds (lmdb keeps the count)."""
        with self._env.begin() as txn:
            others = (txn.get(META_KEY) is not None) + (txn.get(DIRTY_KEY) is not None)
        return self._env.stat()["entries"] - others

    def dirty(self) -> bool:
        """Whether the last writer left before indexing every block it wrote (`write`'s `dirty`)."""
        with self._env.begin() as txn:
            return txn.get(DIRTY_KEY) is not None

    def scan(self, after: bytes = b"", n: int = 8192) -> list[tuple[bytes, bytes]]:
        """Up to n hash records with keys past `after`, in key order (one
        short read transaction per call, so a long walk pins no old pages)."""
        out: list[tuple[bytes, bytes]] = []
        with self._env.begin() as txn:
            cur = txn.cursor()
            more = cur.set_range(after)
            if more and cur.key() == after:
                more = cur.next()
            while more and len(out) < n:
                k = cur.key()
                if len(k) == self._lens[0]:
                    out.append((k, self._record(k, cur.value())))
                more = cur.next()
        return out

    def sample(self, draws: list[bytes]) -> dict[bytes, bytes]:
        """The record at or after each random key of `draws` (wrapping round),
        distinct ones only: hashes are uniform, so these are a fair sample."""
        out: dict[bytes, bytes] = {}
        with self._env.begin() as txn:
            cur = txn.cursor()
            for d in draws:
                ok = cur.set_range(d) or cur.first()
                if ok and len(cur.key()) != self._lens[0]:  # the meta record: the next one
                    ok = cur.next() or cur.first()
                if ok and len(cur.key()) == self._lens[0]:
                    out[cur.key()] = self._record(cur.key(), cur.value())
        return out

    def totals(self) -> tuple[int, int]:
        """(hash records, bytes of the objects they describe), from the meta record."""
        return _parse_meta(self.meta())[0]

    def marks(self) -> dict[int, int]:
        """Slot size -> slots handed out, from the meta record."""
        return _parse_meta(self.meta())[1]

    def recount(self) -> tuple[int, int]:
        """Write the meta record again from every record (an index written
        before there was one, or one whose count disagrees with lmdb's)."""
        blocks = nbytes = 0
        for chunk in walk(self.scan):
            blocks, nbytes = blocks + len(chunk), nbytes + sum(record_size(v) for _, v in chunk)
        with self._env.begin(write=True) as txn:
            txn.put(META_KEY, _meta_record((blocks, nbytes), _parse_meta(txn.get(META_KEY))[1]))
        return blocks, nbytes

    def write(self, puts: dict[bytes, bytes], dels: list[bytes], only_if: dict[bytes, bytes] | None = None,
              marks: dict[int, int] | None = None, dirty: bool | None = None) -> bool:
        """One write transaction: `puts`, `dels`, and each of `only_if` put
        only where the record held now has the same size, checksum and slot
        (an access time for a record no one replaced meanwhile); the meta
        record's totals follow, and the slot `marks` (each only raised);
        `dirty` True or False sets or clears the dirty flag (None: as it is).
        False when the map or the disk is full; lmdb.Error on damage."""
        try:
            with self._env.begin(write=True) as txn:
                (blocks, nbytes), held = _parse_meta(txn.get(META_KEY))
                for c, m in (marks or {}).items():
                    held[c] = max(held.get(c, 0), m)
                for k, v in puts.items():
                    if txn.put(k, v, overwrite=False):  # new, the usual case: one call, no read
                        blocks, nbytes = blocks + 1, nbytes + record_size(v)
                    else:
                        old = txn.get(k)
                        txn.put(k, v)
                        nbytes = max(0, nbytes + record_size(v) - record_size(old))
                for k in dels:  # a damaged record's size can pass the totals: never below zero (the caller recounts)
                    old = txn.pop(k)
                    if old is not None:
                        blocks, nbytes = max(0, blocks - 1), max(0, nbytes - record_size(old))
                for k, v in (only_if or {}).items():
                    now = txn.get(k)
                    if now is not None and now[:_PLACE] == v[:_PLACE]:
                        txn.put(k, v)
                txn.put(META_KEY, _meta_record((blocks, nbytes), held))
                if dirty is not None:
                    (txn.put(DIRTY_KEY, b"1") if dirty else txn.delete(DIRTY_KEY))
            return True
        except lmdb.Error as e:
            if isinstance(e, DAMAGE):
                raise
            # a full map, or the disk full or failing (ENOSPC, or EIO from a commit's sync): a commit
            # that fails leaves the index as it was, so the write failed and nothing is damaged
            log.warning("disk index %s: write failed: %s", self.path, e)
            return False

    def replace(self, problem: str | None, records: dict[bytes, bytes], marks: dict[int, int]) -> None:
        """Set the damaged index aside and write a fresh one of `records` and
        slot `marks` (`problem` None: the index is empty, not damaged; it is filled)."""
        if problem is not None:
            self._old.append(self._env)
            self._set_aside(problem)
            self._env = self._open()
        self.generation += 1
        with self._env.begin(write=True) as txn:
            for k, v in records.items():
                txn.put(k, v)
            txn.put(META_KEY, _meta_record((len(records), sum(record_size(v) for v in records.values())), marks))
            txn.delete(DIRTY_KEY)

    def _set_aside(self, problem: str) -> None:
        """Move the damaged index out of the way (keeping the last one)."""
        for old in self.path.parent.glob(f"{self.path.name}.{_DAMAGED}*"):
            shutil.rmtree(old, ignore_errors=True)
        aside = self.path.with_name(f"{self.path.name}.{_DAMAGED}{time.time_ns()}")
        try:
            if self.path.exists():
                os.rename(self.path, aside)
        except OSError as e:
            raise TierUnavailableError(f"disk index {self.path} is damaged ({problem}) and cannot be moved: {e}")
        self.healed += 1
        log.warning("disk index %s is damaged (%s): moved to %s; rebuilding it", self.path, problem, aside.name)

    def sync(self) -> None:
        """Make every commit so far durable, the meta page too (commits leave
        it to the next one: `metasync` off), unless the index is not synced."""
        if self._sync:
            self._env.sync(True)

    def close(self) -> None:
        for env in [*self._old, self._env]:
            env.close()
        self._old = []
