"""The disk tier's data (tiers/disk.py): block objects in slots of
preallocated segment files, not one file per block.

One file per block costs a file creation, an fsync and a rename per block (2-6x the device's write rate at
real block sizes, 50-80x at small ones: docs/benchmarks.md, issue 19). Here a batch's objects are written into
slots with one `pwritev` each and made durable with one fdatasync per segment file touched.

Layout under `root`:

    <slot size>-<n>    segment files of slots of one size (header + object,
                       rounded up); slot s of that size lives in file
                       s // per_file at (s % per_file) * slot size

A slot begins with a 32-byte header (magic, object size, xxh3_64 of the
object, block hash), so a lost index can be rebuilt from the slots alone
(`scan`) and a read can tell a slot that holds another block. Files grow in
`GROW_BYTES` steps by fallocate, so a full filesystem refuses the write
(ENOSPC) instead of a later write into a hole; at the end, only what the
slot needs. Which slots are free is not recorded here: the index holds the
slot of every block (tiers/disk_space.py tracks the rest).
"""
from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
import xxhash

from tiers.disk_geometry import HEAD, MAGIC, geometry, name, padding, parse, per_file, runs, slot_size
from tiers.disk_index import RECORD
from tiers.disk_io import punch_hole
from tiers.host_copy import XXH3
from tiers.types import HASH_BYTES, BlockHash

try:  # a batch of slot writes in one call (setup.py builds it); Segments.write_many's loop is the reference
    from tiers._slotio import write_slots
except ImportError:  # pragma: no cover - no C compiler where installed
    write_slots = None

log = logging.getLogger(__name__)
_EMPTY_HEAD = bytes(HEAD.size)
GROW_BYTES = 64 << 20  # fallocate step
INDEX_RESERVE_BYTES = 16 << 20  # slots leave a disk's last bytes (or its last eighth) to the index's writes
Check = Callable[[BlockHash, memoryview], bool]  # whether a slot's object is a whole object of that block


class Segments:
    """Segment files under `root` (see the module docstring). Thread-safe:
    distinct slots are written and read concurrently."""

    def __init__(self, root: Path, sync: bool, step_bytes: int = GROW_BYTES) -> None:
        """`step_bytes`: how far past a write a file is allocated ahead (the tier's capacity at most)."""
        self.root, self._sync, self.step = root, sync, max(1, min(step_bytes, GROW_BYTES))
        self.root.mkdir(parents=True, exist_ok=True)
        self._fds: dict[tuple[int, int], int] = {}  # (slot size, file number) -> fd
        self._ends: dict[tuple[int, int], int] = {}  # bytes allocated in each file
        self._lock = threading.Lock()

    @staticmethod
    def _place(size: int, s: int) -> tuple[tuple[int, int], int]:
        slot, per = geometry(size)
        return (slot, s // per), (s % per) * slot

    def path(self, key: tuple[int, int]) -> Path:
        return self.root / name(key)

    def _fd(self, key: tuple[int, int]) -> int:
        with self._lock:
            fd = self._fds.get(key)
            if fd is None:
                fd = self._fds[key] = os.open(self.path(key), os.O_RDWR | os.O_CREAT, 0o644)
                self._ends[key] = os.fstat(fd).st_size
            return fd

    def _grow(self, key: tuple[int, int], fd: int, end: int) -> None:
        """Allocate the file up to `end` bytes (a step past it when the disk has room)."""
        with self._lock:
            have = self._ends[key]
            if end <= have:
                return
            step = min(max(end, have + self.step), per_file(key[0]) * key[0])
            st = os.fstatvfs(fd)
            reserve = min(INDEX_RESERVE_BYTES, st.f_blocks * st.f_frsize // 8)  # the index's writes need room too
            free = st.f_bavail * st.f_frsize - reserve
            if free < end - have:
                raise OSError(errno.ENOSPC, "the disk is full (what is left is the index's)")
            if free < 4 * (step - have):
                step = end  # a nearly full disk: no step ahead
            for want in dict.fromkeys((step, end)):
                try:
                    os.posix_fallocate(fd, have, want - have)
                    break
                except OSError as e:
                    os.ftruncate(fd, have)  # what a failed allocation took is given back (ext4 keeps it)
                    if e.errno != errno.ENOSPC or want == end:
                        raise  # ENOSPC for the slot itself: the disk is full
            self._ends[key] = max(os.fstat(fd).st_size, end)

    def write(self, h: BlockHash, data: memoryview, s: int, csum: int, align: int | None = None) -> tuple[int, int]:
        """Write the object `data` of block `h` (checksum `csum`) into slot `s`
        of its size, zeros after it to a multiple of `align` (`padding` of its
        size when None); the file's key, to `sync`. Raises OSError (ENOSPC: full)."""
        key, off = self._place(len(data), s)
        fd = self._fd(key)
        self._grow(key, fd, off + key[0])
        head = HEAD.pack(MAGIC, len(data), csum, h)
        align = padding([len(data)]) if align is None else align
        pad = bytes(-(off + HEAD.size + len(data)) % align) if align else b""
        n = os.pwritev(fd, [head, data, pad], off)
        if n != HEAD.size + len(data) + len(pad):  # short write: finish it plainly
            whole = head + bytes(data) + pad
            while n < len(whole):
                n += os.pwrite(fd, whole[n:], off + n)
        return key

    def write_many(self, hashes: Sequence[BlockHash], objs: Sequence[torch.Tensor], slots: Sequence[int],
                   durable: bool = False, sizes: Sequence[int] | None = None
                   ) -> tuple[list[int | None], set[tuple[int, int]], OSError | None]:
        """`write` of many objects (1-D uint8 CPU tensors, of `sizes` bytes
        where the caller has them) into their slots, checksums computed
        here: each object's checksum, or None where it was not written; the
        files written to (to `sync`); the first error met (ENOSPC: full).
        With `durable` they are synced here too (in the C call, one GIL
        release for writes and syncs); a failed sync fails them all."""
        sizes = [o.numel() for o in objs] if sizes is None else sizes
        placed = [((g[0], s // g[1]), (s % g[1]) * g[0]) for s, g in zip(slots, map(geometry, sizes))]  # _place
        fds, err, align = *self._grown(placed), padding(sizes)
        if write_slots is not None and XXH3:  # the tensors' memory as such: no numpy view per block
            refs = [(o.data_ptr(), n) for o, n in zip(objs, sizes)]
            sums, code = write_slots(fds, [off for _, off in placed], hashes, refs, XXH3, durable and self._sync, align)
            err = err or (OSError(code, os.strerror(code)) if code else None)
        else:
            sums = []
            for h, o, s, fd in zip(hashes, objs, slots, fds):
                sums.append(None)
                if fd < 0:
                    continue
                d = memoryview(o.numpy())
                csum = xxhash.xxh3_64_intdigest(d)
                try:
                    self.write(h, d, s, csum, align)
                    sums[-1] = csum
                except OSError as e:
                    err = err or e
            files = {key for (key, _), c in zip(placed, sums) if c is not None}
            sums, err = self._synced(sums, files, durable, err)
            return sums, files if any(c is not None for c in sums) else set(), err
        return sums, {key for (key, _), c in zip(placed, sums) if c is not None}, err

    def _synced(self, sums: list[int | None], files: set[tuple[int, int]], durable: bool,
                err: OSError | None) -> tuple[list[int | None], OSError | None]:
        """`write_many`'s sync in Python (the reference for the C call's)."""
        try:
            if durable:
                self.sync(files)
            return sums, err
        except OSError as e:
            return [None] * len(sums), e

    def _grown(self, placed: list[tuple[tuple[int, int], int]]) -> tuple[list[int], OSError | None]:
        """The fd for each placed slot, its file grown past the furthest one
        (-1 where that failed: the first error is returned)."""
        ends: dict[tuple[int, int], int] = {}
        first = placed[0][0] if placed else None
        if all(key == first for key, _ in placed):  # the usual batch: one file
            ends = {first: max(off for _, off in placed) + first[0]} if placed else {}
        else:
            for key, off in placed:
                ends[key] = max(ends.get(key, 0), off + key[0])
        fds, err = {}, None
        for key, end in ends.items():
            try:
                fds[key] = self._fd(key)
                self._grow(key, fds[key], end)
            except OSError as e:
                fds[key], err = -1, err or e
        return [fds[key] for key, _ in placed], err

    def sync(self, keys: set[tuple[int, int]]) -> None:
        """Make the slots written to those files durable (fdatasync each)."""
        if self._sync:
            for key in keys:
                os.fdatasync(self._fd(key))

    def read(self, h: BlockHash, size: int, csum: int, s: int, buf: torch.Tensor) -> bool:
        """Read block `h`'s object from slot `s` into `buf` (`size` bytes):
        True if the slot's header names it and the bytes have checksum `csum`."""
        key, off = self._place(size, s)
        head = bytearray(HEAD.size)
        view = memoryview(buf.numpy())[:size]
        if os.preadv(self._fd(key), [head, view], off) != HEAD.size + size:
            return False
        if HEAD.unpack(head) != (MAGIC, size, csum, h):
            return False
        return xxhash.xxh3_64_intdigest(view) == csum

    def keep(self, size: int, s: int, dest: Path) -> None:
        """Copy the object bytes in slot `s`, as they are, to file `dest` (quarantine)."""
        key, off = self._place(size, s)
        try:
            dest.write_bytes(os.pread(self._fd(key), size, off + HEAD.size))
        except OSError as e:
            log.warning("segments %s: keeping slot %d of %s in quarantine failed: %s", self.root, s, key, e)

    def named(self, size: int, s: int) -> BlockHash | None:
        """The block slot `s`'s header names (a whole header, magic and all;
        None: empty, torn, past its file's end)."""
        key, off = self._place(size, s)
        head = os.pread(self._fd(key), HEAD.size, off)
        if len(head) < HEAD.size:
            return None
        magic, _, _, h = HEAD.unpack(head)
        return BlockHash(h) if magic == MAGIC else None

    def clear(self, size: int, s: int) -> None:
        """Zero slot `s`'s header: a freed slot is not read back as a block by `scan`."""
        key, off = self._place(size, s)
        os.pwrite(self._fd(key), _EMPTY_HEAD, off)

    def punch(self, c: int, slots: Sequence[int]) -> int:
        """Give the disk space of free slots `slots` (of `c` bytes each) back
        to the filesystem: the whole pages of each run of neighbouring slots.
        Bytes given back; raises OSError (EOPNOTSUPP: not on this filesystem)."""
        freed = 0
        for key, start, end in runs(c, slots):
            lo, hi = -(-start // 4096) * 4096, end // 4096 * 4096
            if hi > lo:
                punch_hole(self._fd(key), lo, hi - lo)
                freed += hi - lo
        return freed

    def fill(self, c: int, slots: Sequence[int]) -> tuple[set[int], OSError | None]:
        """Allocate the space of slots `slots` (of `c` bytes each) that `punch`
        gave back, before they are written, so a full disk refuses here: the
        slots that could not be allocated, and the first error."""
        failed, err = set(), None
        for key, start, end in runs(c, slots):
            try:
                os.posix_fallocate(self._fd(key), start, end - start)
            except OSError as e:
                failed, err = failed | {key[1] * per_file(c) + i for i in range(start // c, end // c)}, err or e
        return failed, err

    def ends(self) -> dict[tuple[int, int], int]:
        """Each segment file's length (bytes)."""
        out = {}
        for p in self.root.iterdir():
            key = parse(p.name)
            if key is not None:
                out[key] = p.stat().st_size
        return out

    def held(self, marks: dict[int, int]) -> dict[int, int]:
        """`marks` (slot size -> slots handed out) raised to the end of each
        size's last segment file: past them no slot was ever written."""
        out = dict(marks)
        for (slot, n), length in self.ends().items():
            out[slot] = max(out.get(slot, 0), n * per_file(slot) + length // slot)
        return out

    def found(self, slot: int, slots: Sequence[int], check: Check | None) -> list[tuple[BlockHash, int, int, int]]:
        """(hash, size, checksum, slot) of those of `slots` (of `slot` bytes)
        that hold a whole block (its checksum right and, given a check,
        `check` passed); the header of any other written slot is cleared."""
        out, per = [], per_file(slot)
        for s in slots:
            key, off = (slot, s // per), (s % per) * slot
            fd = self._fd(key)
            if os.pread(fd, 4, off) in (b"", b"\0\0\0\0"):  # never written, or cleared: the usual hole
                continue
            hit = self._scan_one(fd, s, slot, off, check or (lambda h, obj: True))
            if hit is not None:
                out.append(hit)
        return out

    def headed(self, h: BlockHash, size: int, csum: int, s: int, ends: dict[tuple[int, int], int]) -> bool:
        """Whether slot `s` lies inside its file (lengths `ends`) and its header
        names block `h` with this size and checksum (the object is not read)."""
        key, off = self._place(size, s)
        if off + HEAD.size + size > ends.get(key, 0):
            return False
        return HEAD.unpack(os.pread(self._fd(key), HEAD.size, off)) == (MAGIC, size, csum, h)

    def located(self, size: int, s: int) -> tuple[Path, int]:
        """(segment file, offset of the object's bytes) of slot `s`."""
        key, off = self._place(size, s)
        return self.path(key), off + HEAD.size

    def scan(self, check: Check | None) -> Iterator[tuple[BlockHash, int, int, int]]:
        """(hash, size, checksum, slot) of every slot whose object `check`
        finds whole for the hash its header names; other slots are cleared.
        Without a check nothing is trusted: the files are emptied."""
        for key, length in sorted(self.ends().items()):
            slot, per = key[0], per_file(key[0])
            fd = self._fd(key)
            if check is None:
                os.ftruncate(fd, 0)
                with self._lock:
                    self._ends[key] = 0
                continue
            for i in range(min(per, length // slot)):
                found = self._scan_one(fd, key[1] * per + i, slot, i * slot, check)
                if found is not None:
                    yield found

    def records(self, check: Check | None, stamp: int) -> tuple[dict[bytes, bytes], dict[int, set[int]]]:
        """Index records (last access `stamp`) of the whole objects `scan`
        finds, one per block (a second copy's slot is cleared), and the
        slots they use per slot size."""
        kept: dict[bytes, bytes] = {}
        used: dict[int, set[int]] = {}
        for h, size, csum, s in self.scan(check):
            if h in kept:
                self.clear(size, s)
                continue
            kept[h] = RECORD.pack(size, csum, s, stamp)
            used.setdefault(slot_size(size), set()).add(s)
        return kept, used

    def _scan_one(self, fd: int, s: int, slot: int, off: int, check: Check) -> tuple[BlockHash, int, int, int] | None:
        body = os.pread(fd, slot, off)
        magic, size, csum, h = HEAD.unpack_from(body) if len(body) >= HEAD.size else (b"", 0, 0, b"")
        if magic == MAGIC and slot_size(size) == slot and len(body) >= HEAD.size + size:
            obj = memoryview(body)[HEAD.size:HEAD.size + size]
            if xxhash.xxh3_64_intdigest(obj) == csum and check(BlockHash(h), obj):
                return BlockHash(h), size, csum, s
        if magic != b"\0\0\0\0":
            os.pwrite(fd, _EMPTY_HEAD, off)
        return None

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


assert HEAD.size == 32 and HASH_BYTES == 16
