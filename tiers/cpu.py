"""Memory tiers as fixed-slot pools: `SlotPool`, and the pinned host `CpuTier`.

One big ``uint8`` tensor ``[num_slots, slot_bytes]`` is allocated once; a block
object occupies one slot. Puts and loads are plain ``copy_`` calls into and out
of slots, so the hot path allocates nothing (``get_into``) or only the tensor
it hands out (``get_many``).

Concurrency: a short lock guards the free list and the index, never a copy.
A put copies into a slot it reserved but has not yet published; a reader pins
the slot it copies from, and a slot deleted while pinned goes back to the free
list only when its last reader is done. So no copy ever races a reuse.

A `shared` pool lives in a memfd instead of anonymous memory, so a daemon
can hand its file descriptor to a same-host client (cache_service/server/pool.py):
the client then writes block objects straight into slots it `reserve`d, and
the daemon `publish`es them. Its rows start on page boundaries (a row's
stride is its slot size rounded up to a page), and since other processes can
write its bytes, loads from it verify payload checksums (`verify_payload`).
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Iterable, Sequence

import torch

from tiers.base import SlotTier
from tiers.host_copy import copy_all, copy_arrays, copy_hashed, copy_spans, shared_matrix
from tiers.types import BlockHash, CapacityError, ConfigError, TierKVError

log = logging.getLogger(__name__)


class SlotPool(SlotTier):
    """A fixed-slot object pool on one torch device.

    `slot_bytes` None sizes the slots lazily from the first object put. The
    pool holds ``capacity_bytes // slot_bytes`` slots; each object consumes one
    whole slot, whatever its size.
    """

    verify_payload = False

    def __init__(self, capacity_bytes: int, slot_bytes: int | None = None,
                 device: str | torch.device = "cpu", pin: bool = False, prefault: bool = False,
                 shared: bool = False) -> None:
        super().__init__(capacity_bytes)
        assert not (shared and (pin or torch.device(device).type != "cpu")), "a shared pool is plain host memory"
        self.shared = shared
        self.verify_payload = shared  # other processes write a shared pool's bytes
        self.share_fd = -1  # a shared pool's memfd, once allocated
        self.slot_stride = 0  # bytes from one row to the next
        self.prefault = prefault
        self.device = torch.device(device)
        self.pinned = pin
        self.slot_bytes = 0
        self.num_slots = 0
        self._pool: torch.Tensor | None = None
        self._host_rows = None  # the pool as a numpy matrix, when it is host memory
        self._free: list[int] = []
        self._index: dict[BlockHash, tuple[int, int]] = {}  # hash -> (slot, nbytes)
        self._readers: dict[int, int] = {}  # slot -> copies in flight out of it
        self._released: set[int] = set()  # deleted slots still being read
        self._closed = False
        self._lock = threading.Lock()
        self._sized_by_first = slot_bytes is None  # slots sized by the first object put
        self._too_big: set[int] = set()  # object sizes refused for the slots (each logged once)
        if slot_bytes is not None:
            self._allocate(slot_bytes)

    # -- sizing -----------------------------------------------------------------

    def _allocate(self, slot_bytes: int) -> None:
        """Allocate the pool; caller holds the lock or is the constructor."""
        if slot_bytes <= 0:
            raise CapacityError(f"{self.name}: slot size must be positive, got {slot_bytes}")
        if slot_bytes > self.capacity_bytes:
            raise CapacityError(
                f"{self.name}: slot of {slot_bytes} B exceeds capacity {self.capacity_bytes} B")
        num_slots = self.capacity_bytes // slot_bytes
        try:
            if self.shared:
                self._pool, self.share_fd, self.slot_stride = shared_matrix(num_slots, slot_bytes, self.name)
            else:
                self._pool = torch.empty((num_slots, slot_bytes), dtype=torch.uint8,
                                         device=self.device, pin_memory=self.pinned)
                self.slot_stride = slot_bytes
        except (RuntimeError, OSError, MemoryError) as e:  # a miss for this tier, not an error in the engine
            raise CapacityError(f"{self.name}: cannot allocate {self.capacity_bytes} B for its pool ({e}); "
                                f"lower its capacity") from None
        self.num_slots = num_slots
        self._host_rows = self._pool.numpy() if self._pool.device.type == "cpu" else None
        self._free = list(range(self.num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.slot_bytes = slot_bytes
        if self.prefault and self.device.type == "cpu" and not self.pinned:  # pinned memory is resident
            threading.Thread(target=self._prefault, name=f"{self.name}-prefault", daemon=True).start()

    def _prefault(self, piece: int = 256 << 10) -> None:
        """Write every free slot once, off the hot path, so that first puts do
        not page-fault in fresh memory (~15 ms per MB on a small VM). Opt-in
        (`prefault`): it costs a core for seconds per GiB, which a long-lived
        daemon pays once and a one-shot CLI run should not.

        Each piece is zeroed under the lock, and only while its slot is in
        the free list, so the toucher never writes a live slot and free_bytes
        stays exact; a put waits at most one small piece. Slots are taken from
        the front of the free list (handed out last: puts and deletes work at
        its end), so it usually runs ahead of the puts.
        """
        done, off = 0, 0
        while True:
            with self._lock:
                if self._closed or self._pool is None or done >= len(self._free):
                    return
                self._pool[self._free[done], off: off + piece].zero_()
            off += piece
            if off >= self.slot_bytes:
                done, off = done + 1, 0

    def footprint(self, nbytes: int) -> int:
        """One whole slot; CapacityError if `nbytes` can never fit a slot."""
        if self.slot_bytes == 0:
            if nbytes > self.capacity_bytes:
                raise CapacityError(
                    f"{self.name}: object of {nbytes} B exceeds capacity {self.capacity_bytes} B")
            return nbytes  # the first put will size slots to exactly this
        if nbytes > self.slot_bytes:
            if self._sized_by_first and nbytes not in self._too_big:  # another model's blocks, say: say so once
                self._too_big.add(nbytes)
                log.warning("%s: objects of %d B skip this tier: its slots are %d B, sized by its first object; "
                            "set its slot_bytes to the largest block size its clients use", self.name, nbytes,
                            self.slot_bytes)
            raise CapacityError(f"{self.name}: object of {nbytes} B exceeds slot size {self.slot_bytes} B")
        return self.slot_bytes

    def free_bytes(self) -> int:
        with self._lock:
            if self.slot_bytes == 0:
                return 0 if self._closed else self.capacity_bytes
            return len(self._free) * self.slot_bytes

    # -- writes -----------------------------------------------------------------

    def put_many(self, hashes: Sequence[BlockHash], objs: Sequence[torch.Tensor]) -> list[bool]:
        assert len(hashes) == len(objs), "one object per hash"
        for obj in objs:
            assert obj.dtype == torch.uint8 and obj.dim() == 1 and obj.is_contiguous(), \
                "objects are 1-D contiguous uint8 tensors"
        with self._lock:
            self._check_open()
            if self._pool is None and objs:
                self._allocate(objs[0].numel())
            sizes = [obj.numel() for obj in objs]
            if sizes:  # all or nothing: refuse the batch before storing any of it
                self.footprint(max(sizes))
            todo = self._reserve(hashes)
            rows = self._host_rows if all(o.is_cpu for o in objs) else None
            copies = [(self._slot(slot, sizes[i]), objs[i]) for i, slot in todo] if rows is None else []
        try:
            if rows is None:
                copy_all(copies)
            elif not self._copy_spans(rows, objs, sizes, todo):  # host to host: numpy views off the pool (not torch's: ~2 us)
                copy_arrays([rows[slot, :sizes[i]] for i, slot in todo], [objs[i].numpy() for i, _ in todo])
        except BaseException:
            with self._lock:
                self._free.extend(slot for _, slot in todo)
            raise
        self._publish(hashes, sizes, todo)
        return self.contains_many(hashes)

    @staticmethod
    def _copy_spans(rows, objs: Sequence[torch.Tensor], sizes: list[int], todo: list[tuple[int, int]]) -> bool:
        """Host objects (of `sizes` bytes) into their slots of the host pool `rows` by address (`copy_spans`)."""
        base, stride = rows.ctypes.data, rows.strides[0]
        srcs = [(objs[i].data_ptr(), sizes[i]) for i, _ in todo]
        return copy_spans([(base + slot * stride, n) for (_, slot), (_, n) in zip(todo, srcs)], srcs)

    def _reserve(self, hashes: Sequence[BlockHash]) -> list[tuple[int, int]]:
        """(position in batch, slot) for each new hash that gets a free slot
        (caller holds the lock)."""
        todo: list[tuple[int, int]] = []
        seen: set[BlockHash] = set()
        for i, h in enumerate(hashes):  # h None: a slot for no block yet
            if (h is None or h not in self._index and h not in seen) and self._free:
                seen.add(h)
                todo.append((i, self._free.pop()))
        return todo

    def _publish(self, hashes: Sequence[BlockHash], sizes: Sequence[int],
                 todo: list[tuple[int, int]]) -> list[bool]:
        """Make freshly written slots visible (True per slot of `todo`); a racing
        put of the same hash wins, and the slot goes back to the free list."""
        added = nbytes_in = 0
        done = []
        with self._lock:
            for i, slot in todo:
                h = hashes[i]
                done.append(not self._closed and h not in self._index)
                if not done[-1]:
                    self._free.append(slot)
                    continue
                self._index[h] = (slot, sizes[i])
                added += 1
                nbytes_in += sizes[i]
            self.stats.add(blocks=added, used_bytes=added * self.slot_bytes, bytes_in=nbytes_in)
        return done

    # -- writes by another process (shared pools) ---------------------------------

    def reserve_free(self, n: int, nbytes: int) -> list[int]:
        """Up to n free slots for objects of `nbytes` not yet for any block
        (`reserve` without hashes)."""
        return [s for s in self.reserve([None] * n, nbytes) if s is not None]

    def reserve(self, hashes: Sequence[BlockHash], nbytes: int) -> list[int | None]:
        """A free slot for each hash this pool does not hold, for an object of
        `nbytes` that someone else writes (None: held, repeated in the batch,
        or no free slot left). The slots are nobody's until `publish` or
        `unreserve`. Sizes a lazily sized pool; CapacityError if `nbytes`
        can never fit a slot."""
        with self._lock:
            self._check_open()
            if self._pool is None:
                self._allocate(nbytes)
            self.footprint(nbytes)
            out: list[int | None] = [None] * len(hashes)
            for i, slot in self._reserve(hashes):
                out[i] = slot
        return out

    def publish(self, hashes: Sequence[BlockHash], slots: Sequence[int], nbytes: int) -> list[bool]:
        """Make reserved slots, written meanwhile, the objects (`nbytes` each) of
        `hashes`; False where a racing put of the same hash won."""
        return self._publish(hashes, [nbytes] * len(hashes), list(enumerate(slots)))

    def unreserve(self, slots: Iterable[int]) -> None:
        """Hand reserved slots back unwritten."""
        with self._lock:
            if not self._closed:
                self._free.extend(slots)

    @property
    def rows(self) -> torch.Tensor:
        """The pool as one ``[num_slots, slot_bytes]`` tensor (rows `slot_stride` apart)."""
        assert self._pool is not None, "the pool is not sized yet"
        return self._pool

    def delete_many(self, hashes: Iterable[BlockHash]) -> int:
        removed = 0
        with self._lock:
            for h in hashes:
                entry = self._index.pop(h, None)
                if entry is None:
                    continue
                removed += 1
                slot = entry[0]
                if self._readers.get(slot):
                    self._released.add(slot)  # freed by the last reader
                else:
                    self._free.append(slot)
            self.stats.add(blocks=-removed, used_bytes=-removed * self.slot_bytes)
        return removed

    # -- reads ------------------------------------------------------------------

    def get_many(self, hashes: Sequence[BlockHash]) -> list[torch.Tensor | None]:
        """Fresh tensors on this tier's device; the caller owns them."""
        found = self._acquire(hashes)
        out: list[torch.Tensor | None] = [None] * len(hashes)
        copies = []
        try:
            for i, entry in enumerate(found):
                if entry is not None:
                    out[i] = torch.empty(entry[1].numel(), dtype=torch.uint8, device=self.device)
                    copies.append((out[i], entry[1]))
            copy_all(copies)
        finally:
            self._release(found)
        return out

    def get_into(self, hashes: Sequence[BlockHash], outs: Sequence[torch.Tensor],
                 hash_from: int | None = None) -> list:
        """Copy each held object into the prefix of the caller's buffer (any device).

        The allocation-free load path. Returns False for a miss, leaving that
        buffer untouched. Copies are issued non-blocking where a pinned host
        side allows it and complete before this returns. With `hash_from`
        (host buffers) each hit's entry is the xxh3_64 of its copy's bytes
        from that offset on instead of True, computed as they are copied
        (`host_copy.copy_hashed`), and a miss's is None.
        """
        assert len(hashes) == len(outs), "one buffer per hash"
        found = self._acquire(hashes)
        copies = []
        try:
            for entry, out in zip(found, outs):
                if entry is None:
                    continue
                n = entry[1].numel()
                if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < n:
                    raise TierKVError(f"{self.name}: get_into buffer must be 1-D uint8 of >= {n} B")
                copies.append((out[:n], entry[1]))
            if hash_from is not None:
                got = iter(copy_hashed([d.numpy() for d, _ in copies], [s.numpy() for _, s in copies], hash_from))
                return [None if entry is None else next(got) for entry in found]
            copy_all(copies)
        finally:
            self._release(found)
        return [entry is not None for entry in found]

    def hold(self, hashes: Sequence[BlockHash]) -> list[tuple[int, torch.Tensor] | None]:
        return self._acquire(hashes, count=False)

    def let_go(self, held: Sequence[tuple[int, torch.Tensor] | None]) -> None:
        self._release(held)

    def _acquire(self, hashes: Sequence[BlockHash], count: bool = True) -> list[tuple[int, torch.Tensor] | None]:
        """(slot, view of the object) per hash, the slot pinned against reuse
        until `_release`; counts hits and misses (reads, not holds)."""
        found: list[tuple[int, torch.Tensor] | None] = []
        with self._lock:
            self._check_open()
            for h in hashes:
                entry = self._index.get(h)
                if entry is None:
                    found.append(None)
                    continue
                self._readers[entry[0]] = self._readers.get(entry[0], 0) + 1
                found.append((entry[0], self._slot(*entry)))
        if count:
            hits = [view.numel() for _, view in filter(None, found)]
            self.stats.add(hits=len(hits), misses=len(found) - len(hits), bytes_out=sum(hits))
        return found

    def _release(self, found: Sequence[tuple[int, torch.Tensor] | None]) -> None:
        with self._lock:
            for entry in found:
                if entry is None:
                    continue
                slot = entry[0]
                left = self._readers[slot] - 1
                if left:
                    self._readers[slot] = left
                    continue
                del self._readers[slot]
                if slot in self._released:
                    self._released.discard(slot)
                    self._free.append(slot)

    # -- queries ----------------------------------------------------------------

    def contains_many(self, hashes: Sequence[BlockHash]) -> list[bool]:
        with self._lock:
            return list(map(self._index.__contains__, hashes))

    def keys(self) -> list[BlockHash]:
        """Held hashes, oldest put first."""
        with self._lock:
            return list(self._index)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._index.clear()
            self._free.clear()
            self._pool = self._host_rows = None
            if self.share_fd >= 0:  # clients that mapped it keep its memory until they unmap
                os.close(self.share_fd)
                self.share_fd = -1
            self.stats.add(blocks=-self.stats.blocks, used_bytes=-self.stats.used_bytes)

    def _slot(self, slot: int, nbytes: int) -> torch.Tensor:
        assert self._pool is not None
        return self._pool[slot, :nbytes]

    def _check_open(self) -> None:
        if self._closed:
            raise TierKVError(f"{self.name}: tier is closed")


class CpuTier(SlotPool):
    """Host-memory tier: a slot pool, page-locked when CUDA is present so
    loads to and stores from the GPU run as async DMA."""

    name = "cpu"

    def __init__(self, capacity_bytes: int, slot_bytes: int | None = None, pin: bool | None = None,
                 prefault: bool = False, shared: bool = False) -> None:
        if pin and shared:
            raise ConfigError("cpu tier: a shared pool is not page-locked (pin = auto or no)")
        if pin is None:
            pin = torch.cuda.is_available() and not shared
        elif pin and not torch.cuda.is_available():
            raise ConfigError("cpu tier: pin=True needs a CUDA device (use auto)")
        super().__init__(capacity_bytes, slot_bytes, device="cpu", pin=pin, prefault=prefault, shared=shared)
