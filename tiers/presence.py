"""Which blocks a tier of millions holds, in 8 bytes each: lookups at memory speed.

An open-addressing table of the first 8 bytes of each held hash (uint64) in
buckets of 8 slots, one 64-byte cache line each; load at most 1/2, so about
16 bytes of RAM per block. A key lives in its home bucket or, when that was
full, in the buckets after it. A lookup of 256 hashes reads one bucket per
hash in one vectorized gather and compares all 8 slots at once; only keys
whose home bucket is full (no empty slot: ~2% of buckets at load 1/2) look
further. Block hashes are uniform, so their first 8 bytes pick the bucket
(no further hashing). Two held or asked hashes that share their first 8
bytes would read as each other: a chance of about N / 2**64 per miss asked
(1e-13 at 3M blocks); the cost of one is a lookup that says "held", then a
read that misses and recomputes, never a wrong block (reads check the index
and the checksum).

Not thread-safe: the owner serializes `add`, `discard` and `contains`.
"""
from __future__ import annotations

from typing import Callable, Sequence, TypeVar

import numpy as np

T = TypeVar("T")

try:  # lookup and insert in one C call each (setup.py builds them); numpy `_find` / `_place` are the references
    from tiers._presence import add as _add, contains as _contains
except ImportError:  # pragma: no cover - no C compiler where installed
    _add = _contains = None

_EMPTY, _GONE = 0, 1  # slot values; keys below 2 are stored as 2 (their chance: 2**-63)
WAYS = 8  # slots per bucket: 8 uint64 = one cache line
_MIN_BUCKETS = 1 << 9


def keys_of(hashes: Sequence[bytes]) -> np.ndarray:
    """The table keys (uint64) of block hashes."""
    raw = b"".join(hashes)
    if len(raw) == 16 * len(hashes):  # block hashes: every other u64 is a key
        k = np.frombuffer(raw, dtype="<u8")[::2]
    else:
        k = np.frombuffer(b"".join(h[:8].ljust(8, b"\0") for h in hashes), dtype="<u8")
    return np.maximum(k, np.uint64(2)).astype(np.uint64, copy=False)


def _any_row(flags: np.ndarray) -> np.ndarray:
    """Per row of a C-contiguous [n, 8] bool array, whether any is set (one u64 each)."""
    return flags.view(np.uint64)[:, 0] != 0


class PresenceTable:
    """A set of block hashes, 8 bytes each; see the module docstring."""

    def __init__(self, expected: int = 0) -> None:
        self._buckets = np.zeros((_buckets_for(expected), WAYS), dtype=np.uint64)
        self._live = self._used = 0  # keys held; slots not empty (keys and tombstones)

    def __len__(self) -> int:
        return self._live

    @property
    def nbytes(self) -> int:
        return self._buckets.nbytes

    def contains(self, hashes: Sequence[bytes]) -> list[bool]:
        """Whether each hash is held."""
        if not hashes:
            return []
        if _contains is not None:
            return _contains(self._buckets, hashes)
        return self._find(keys_of(hashes))[0].tolist()

    def _find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found, [bucket, way] where found) per key; the second is
        meaningful only where found."""
        mask = len(self._buckets) - 1
        bucket = (keys & np.uint64(mask)).astype(np.intp)
        win = np.take(self._buckets, bucket, axis=0)  # one cache line per key
        eq = win == keys[:, None]
        found = _any_row(eq)
        way = eq.argmax(axis=1)
        active = np.flatnonzero(~found & ~_any_row(win == _EMPTY))  # home bucket full: look on
        while active.size:
            bucket[active] = (bucket[active] + 1) & mask
            win = np.take(self._buckets, bucket[active], axis=0)
            eq = win == keys[active][:, None]
            hit = _any_row(eq)
            found[active[hit]] = True
            way[active[hit]] = eq[hit].argmax(axis=1)
            active = active[~hit & ~_any_row(win == _EMPTY)]
        return found, np.stack([bucket, way], axis=1)

    def add(self, hashes: Sequence[bytes]) -> None:
        """Hold these hashes (those held already are unchanged)."""
        if hashes:
            self._add_keys(keys_of(hashes), _add)

    def _add_keys(self, keys: np.ndarray, c_add: Callable | None) -> None:
        """`c_add`: the C insert (which skips held and repeated keys itself), or None for numpy's."""
        assert keys.dtype == np.uint64, keys.dtype
        if c_add is None:
            keys = np.unique(keys)
            keys = keys[~self._find(keys)[0]]
        if 2 * (self._used + len(keys)) > self._buckets.size:
            self._grow(len(keys), c_add)
        if c_add is None:
            self._place(keys)
        else:  # ~20 numpy calls per batch otherwise: 2 us a block at 256 a put (#19)
            placed, took = c_add(self._buckets, keys)
            self._live, self._used = self._live + placed, self._used + took

    def _place(self, keys: np.ndarray) -> None:
        """Insert distinct keys not held, each in the first free slot of its bucket chain."""
        mask = len(self._buckets) - 1
        bucket = (keys & np.uint64(mask)).astype(np.intp)
        self._live += len(keys)
        while keys.size:
            win = np.take(self._buckets, bucket, axis=0)
            free = (win == _EMPTY) | (win == _GONE)
            room = np.flatnonzero(_any_row(free))
            _, first = np.unique(bucket[room], return_index=True)  # one key per bucket this round
            chosen = room[first]
            way = free[chosen].argmax(axis=1)
            self._used += int(np.count_nonzero(self._buckets[bucket[chosen], way] == _EMPTY))
            self._buckets[bucket[chosen], way] = keys[chosen]
            full = np.ones(len(keys), dtype=bool)
            full[room] = False  # keys whose bucket had room retry it; the others move on
            bucket[full] = (bucket[full] + 1) & mask
            left = np.ones(len(keys), dtype=bool)
            left[chosen] = False
            keys, bucket = keys[left], bucket[left]

    def discard(self, hashes: Sequence[bytes]) -> None:
        """Stop holding these hashes (those not held are ignored)."""
        if not hashes:
            return
        found, where = self._find(np.unique(keys_of(hashes)))
        self._buckets[where[found, 0], where[found, 1]] = _GONE
        self._live -= int(np.count_nonzero(found))

    def _grow(self, more: int, c_add: Callable | None) -> None:
        """Rehash into a table sized for the live keys plus `more` (tombstones dropped)."""
        live = self._buckets[self._buckets > _GONE]
        self._buckets = np.zeros((_buckets_for(len(live) + more), WAYS), dtype=np.uint64)
        self._live = self._used = 0
        self._add_keys(live, c_add)


def _buckets_for(n: int) -> int:
    """Buckets for n keys at a load of at most 3/8 (room to grow before the next rehash)."""
    return max(_MIN_BUCKETS, 1 << max(0, int(np.ceil(np.log2(max(1, n) * 8 / 3 / WAYS)))))


def read_where(maybe: list[bool] | None, hashes: Sequence[bytes], read: Callable[[list[bytes]], list[T]],
               default: T) -> list[T]:
    """`read` of the hashes where `maybe` is True (None: of all), `default`
    for the others: the exact answer asked only where the table cannot rule
    a block out."""
    if maybe is None:
        return read(list(hashes))
    todo = [h for h, m in zip(hashes, maybe) if m]
    got = iter(read(todo) if todo else [])
    return [next(got) if m else default for m in maybe]
