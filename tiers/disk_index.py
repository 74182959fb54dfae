"""The disk tier's lmdb index (tiers/disk.py), and how it heals.

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
- opening it reads every entry (the tier mirrors them in memory), so
  damage in any page in use is met at open, as an lmdb error;
- either way the index is moved aside (``index.lmdb.damaged-<ns>``, the
  last one kept for forensics) and a fresh one opened: `entries` is then
  None and the tier rebuilds it from its data files' own headers;
- a write that meets damage later (a page no read touched) rewrites a fresh
  index from the tier's mirror, then applies the write.

Each heal is logged once and counted in `healed`.
"""
from __future__ import annotations

import logging
import os
import shutil
import struct
import time
from pathlib import Path
from typing import Callable

import lmdb

from tiers.types import TierUnavailableError

log = logging.getLogger(__name__)

# lmdb 0.9 meta page (two of them, pages 0 and 1): a 16-byte page header, then
# magic u32 @16, version u32 @20, the free DB's md_pad (the page size) u32 @40,
# last page in use u64 @136, transaction id u64 @144
_META = struct.Struct("<I")
_META_MAGIC, _DATA_VERSION = 0xBEEFC0DE, 1
_DAMAGED = "damaged-"
_LONGEST_RECORD = (1 << 32) + (1 << 20)  # what a damaged 32-bit record length can reach past its page

Mirror = Callable[[], dict[bytes, bytes]]


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
    """hash -> packed entry in lmdb at `path`; see the module docstring.

    `entries`: what the index held at open, or None when it was damaged and
    set aside (the owner rebuilds, then `write`s what it found). Every
    record has `key_len` and `value_len` bytes."""

    def __init__(self, path: Path, map_size: int, sync: bool, key_len: int, value_len: int) -> None:
        self.path, self._sync, self._lens = path, sync, (key_len, value_len)
        self._map_size = max(map_size, 2 * _LONGEST_RECORD)  # the extension is mapped too
        self.healed = 0
        self.entries: dict[bytes, bytes] | None = None
        problem = vet(path)
        if problem is None:
            try:
                self._env = self._open()
                self.entries = self._read_all()
                return
            except (lmdb.Error, TierUnavailableError) as e:
                problem = str(e)
                self._close_quietly()
        self._set_aside(problem)
        self._env = self._open()

    def _read_all(self) -> dict[bytes, bytes]:
        """Every record, after checking its lengths (lmdb.Error if one is wrong)."""
        out = {}
        with self._env.begin(buffers=True) as txn:
            for k, v in txn.cursor():
                if (len(k), len(v)) != self._lens:
                    raise lmdb.CorruptedError(f"a record of {len(k)}+{len(v)} bytes, not {self._lens}")
                out[bytes(k)] = bytes(v)
        return out

    def _open(self) -> lmdb.Environment:
        try:
            return lmdb.open(str(self.path), map_size=self._map_size, subdir=True, sync=self._sync,
                             metasync=self._sync, readahead=False, max_dbs=0)
        except lmdb.Error as e:
            raise TierUnavailableError(f"disk index {self.path}: cannot open: {e}") from e

    def _close_quietly(self) -> None:
        env, self._env = getattr(self, "_env", None), None
        if env is not None:
            env.close()

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

    def write(self, puts: dict[bytes, bytes], dels: list[bytes], mirror: Mirror) -> bool:
        """One write transaction; on damage met now, a fresh index written
        from `mirror()` (every entry the owner holds) and then this write.
        False when the write failed (the map is full, the disk refused)."""
        try:
            self._apply(puts, dels)
            return True
        except lmdb.MapFullError as e:
            log.warning("disk index %s: full: %s", self.path, e)
            return False
        except (lmdb.Error, TierUnavailableError) as e:
            problem = str(e)
        self._close_quietly()
        self._set_aside(problem)
        try:
            self._env = self._open()
            self._apply(mirror() | puts, dels)
            return True
        except (lmdb.Error, TierUnavailableError) as e:
            log.warning("disk index %s: rebuilding failed: %s", self.path, e)
            return False

    def _apply(self, puts: dict[bytes, bytes], dels: list[bytes]) -> None:
        if self._env is None:  # a rebuild failed: try again
            self._env = self._open()
        with self._env.begin(write=True) as txn:
            for k, v in puts.items():
                txn.put(k, v)
            for k in dels:
                txn.delete(k)

    def close(self) -> None:
        self._close_quietly()
