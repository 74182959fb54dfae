"""Which blocks a tier of millions holds, in 8 bytes each: lookups at memory speed.

An open-addressing table of the first 8 bytes of each held hash (uint64,
linear probing, load at most 1/2): about 16 bytes of RAM per block, and a
lookup of 256 hashes is a few vectorized numpy passes instead of 256 index
reads. Block hashes are uniform, so their first 8 bytes are the slot (no
further hashing). Two held or asked hashes that share their first 8 bytes
would read as each other: a chance of about N / 2**64 per miss asked (1e-13
at 3M blocks); the cost of one is a lookup that says "held", then a read
that misses and recomputes, never a wrong block (reads check the index and
the checksum).

Not thread-safe: the owner serializes `add`, `discard` and `contains`.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

_EMPTY, _GONE = 0, 1  # slot values; keys below 2 are stored as 2 (their chance: 2**-63)
_MIN_SLOTS = 1 << 12
_STEPS = np.arange(8, dtype=np.uint64)  # slots a probe past the first reads at once


def keys_of(hashes: Sequence[bytes]) -> np.ndarray:
    """The table keys (uint64) of block hashes."""
    raw = b"".join(hashes)
    if len(raw) == 16 * len(hashes):  # block hashes: every other u64 is a key
        k = np.frombuffer(raw, dtype="<u8")[::2]
    else:
        k = np.frombuffer(b"".join(h[:8].ljust(8, b"\0") for h in hashes), dtype="<u8")
    return np.maximum(k, np.uint64(2)).astype(np.uint64, copy=False)


class PresenceTable:
    """A set of block hashes, 8 bytes each; see the module docstring."""

    def __init__(self, expected: int = 0) -> None:
        self._slots = np.zeros(_size_for(expected), dtype=np.uint64)
        self._live = self._used = 0  # keys held; slots not empty (keys and tombstones)

    def __len__(self) -> int:
        return self._live

    @property
    def nbytes(self) -> int:
        return self._slots.nbytes

    def contains(self, hashes: Sequence[bytes]) -> list[bool]:
        """Whether each hash is held."""
        if not hashes:
            return []
        return self._find(keys_of(hashes))[0].tolist()

    def _find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found, slot index where found or where the probe ended) per key."""
        mask = np.uint64(len(self._slots) - 1)
        idx = keys & mask
        v = self._slots[idx]  # the first probe, for all at once: most end here
        found = v == keys
        active = np.flatnonzero(~found & (v != _EMPTY))
        idx[active] = (idx[active] + np.uint64(1)) & mask
        while active.size:  # the rest: a window of slots each (slots once used are never empty again,
            where = (idx[active][:, None] + _STEPS) & mask  # so a key lies before any empty one of its chain)
            win = self._slots[where]
            eq = win == keys[active][:, None]
            hit = eq.any(axis=1)
            found[active[hit]] = True
            idx[active[hit]] = where[hit, eq[hit].argmax(axis=1)]
            active = active[~hit & ~(win == _EMPTY).any(axis=1)]
            idx[active] = (idx[active] + np.uint64(len(_STEPS))) & mask
        return found, idx

    def add(self, hashes: Sequence[bytes]) -> None:
        """Hold these hashes (those held already are unchanged)."""
        if hashes:
            self._add_keys(np.unique(keys_of(hashes)))

    def _add_keys(self, keys: np.ndarray) -> None:
        found, _ = self._find(keys)
        keys = keys[~found]
        if 2 * (self._used + len(keys)) > len(self._slots):
            self._grow(len(keys))
        self._place(keys)

    def _place(self, keys: np.ndarray) -> None:
        """Insert distinct keys not held, each in the first free slot of its probe."""
        mask = np.uint64(len(self._slots) - 1)
        idx = keys & mask
        self._live += len(keys)
        while keys.size:
            v = self._slots[idx]
            free = np.flatnonzero((v == _EMPTY) | (v == _GONE))
            slots, first = np.unique(idx[free], return_index=True)  # one key per free slot this round
            self._used += int(np.count_nonzero(self._slots[slots] == _EMPTY))
            self._slots[slots] = keys[free[first]]
            placed = np.zeros(len(keys), dtype=bool)
            placed[free[first]] = True
            keys, idx = keys[~placed], (idx[~placed] + np.uint64(1)) & mask

    def discard(self, hashes: Sequence[bytes]) -> None:
        """Stop holding these hashes (those not held are ignored)."""
        if not hashes:
            return
        found, idx = self._find(np.unique(keys_of(hashes)))
        self._slots[idx[found]] = _GONE
        self._live -= int(np.count_nonzero(found))

    def _grow(self, more: int) -> None:
        """Rehash into a table sized for the live keys plus `more` (tombstones dropped)."""
        live = self._slots[self._slots > _GONE]
        self._slots = np.zeros(_size_for(len(live) + more), dtype=np.uint64)
        self._live = self._used = 0
        self._place(live)


def _size_for(n: int) -> int:
    """Slots for n keys at a load of at most 3/8 (room to grow before the next rehash)."""
    return max(_MIN_SLOTS, 1 << int(np.ceil(np.log2(max(1, n) * 8 / 3))))
