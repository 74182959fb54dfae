"""The disk tier gives the space of free slots back to the filesystem: each
slot size has segment files of its own, so a cache whose blocks change size
(another model, another block size) would otherwise hold its capacity again
in every old size's free slots."""
from __future__ import annotations

import errno
import logging
import os
from collections import deque
from pathlib import Path

import torch
import xxhash

import tiers.disk_slots as disk_slots
from tiers.disk import DiskTier
from tiers.disk_space import FreeSlots

MB = 1 << 20


def allocated(tier: DiskTier) -> int:
    """Bytes the filesystem holds for the tier's segment files."""
    return sum(p.stat().st_blocks * 512 for p in (tier.root / "segments").iterdir())


def key(tag: str, i: int) -> bytes:
    return xxhash.xxh3_128_digest(f"{tag}-{i}".encode())


def block(size: int, i: int) -> torch.Tensor:
    return torch.full((size,), i % 251, dtype=torch.uint8)


def fill_evicting(tier: DiskTier, held: deque, tag: str, size: int, n: int) -> None:
    """Store n blocks of `size` bytes, deleting the oldest held as the store's eviction would."""
    for i in range(n):
        while tier.free_bytes() < size + 64:
            tier.delete_many([held.popleft()[0]])
        assert tier.put_many([key(tag, i)], [block(size, i)]) == [True]
        held.append((key(tag, i), size, i))


def test_a_cache_whose_blocks_change_size_stays_near_its_capacity_on_disk(tmp_path):
    # A 32 MiB tier is filled with blocks of one size, then of three others in turn, evicting the oldest.
    tier = DiskTier(tmp_path, 32 * MB, fsync=False)
    held: deque = deque()
    sizes = [32 << 10, 48 << 10, 80 << 10, 24 << 10]
    for n, size in enumerate(sizes):
        fill_evicting(tier, held, f"s{n}", size, 2 * (32 * MB) // size)
    # The files hold the capacity, the slack and each size's step ahead at most (four times the capacity before).
    step = tier.segments.step
    assert allocated(tier) <= 32 * MB + (1 + len(sizes)) * step + MB, allocated(tier) / MB
    # Every block still held reads back whole.
    got = tier.get_many([h for h, _, _ in held])
    assert all(torch.equal(g, block(size, i)) for g, (_, size, i) in zip(got, held))
    tier.close()


def test_slots_given_back_are_allocated_again_before_they_are_written(tmp_path, monkeypatch):
    # Blocks of one size are stored, then deleted past the slack: their space goes back.
    tier = DiskTier(tmp_path, 32 * MB, fsync=False)
    hs = [key("a", i) for i in range(256)]
    assert all(tier.put_many(hs, [block(64 << 10, i) for i in range(256)]))
    full = allocated(tier)
    tier.delete_many(hs)
    assert allocated(tier) < full - 8 * MB
    # New blocks of that size take those slots again, each allocated before its write.
    filled = []
    real = os.posix_fallocate
    monkeypatch.setattr(os, "posix_fallocate", lambda fd, off, n: (filled.append(n), real(fd, off, n)))
    again = [key("b", i) for i in range(256)]
    assert all(tier.put_many(again, [block(64 << 10, i + 1) for i in range(256)]))
    assert sum(filled) >= 200 * (64 << 10)
    # They read back whole, in this process and after a reopen.
    assert all(torch.equal(g, block(64 << 10, i + 1)) for i, g in enumerate(tier.get_many(again)))
    tier.close()
    tier = DiskTier(tmp_path, 32 * MB, fsync=False)
    assert all(torch.equal(g, block(64 << 10, i + 1)) for i, g in enumerate(tier.get_many(again)))
    tier.close()


def test_a_hole_the_full_disk_cannot_fill_fails_its_put_and_loses_no_slot(tmp_path, monkeypatch):
    # Slots given back, then the filesystem refuses to allocate them again.
    tier = DiskTier(tmp_path, 32 * MB, fsync=False)
    hs = [key("a", i) for i in range(256)]
    assert all(tier.put_many(hs, [block(64 << 10, i) for i in range(256)]))
    tier.delete_many(hs)

    def full(fd, off, n):
        raise OSError(errno.ENOSPC, "full")
    monkeypatch.setattr(os, "posix_fallocate", full)
    # Puts take the free slots that kept their space; those into holes are refused (a full disk).
    done = tier.put_many([key("b", i) for i in range(256)], [block(64 << 10, i) for i in range(256)])
    kept = tier.segments.step // 2 // (64 << 10)
    assert done == [True] * sum(done) + [False] * (256 - sum(done)) and kept - 2 <= sum(done) <= kept + 2
    # The slots refused are holes still: the next put into one is refused again, not written unallocated.
    assert tier.put_many([key("d", 0)], [block(64 << 10, 2)]) == [False]
    # Once the disk has room, the same slots are handed out and written.
    monkeypatch.undo()
    again = [key("c", i) for i in range(256 - sum(done))]
    assert all(tier.put_many(again, [block(64 << 10, i) for i in range(len(again))]))
    assert tier.space.marks[disk_slots.slot_size(64 << 10)] == 256
    tier.close()


def test_a_filesystem_that_cannot_punch_holes_keeps_the_space_and_says_so_once(tmp_path, monkeypatch, caplog):
    # Punching holes is refused (EOPNOTSUPP) by this filesystem.
    calls = []

    def refuse(fd, off, n):
        calls.append(n)
        raise OSError(errno.EOPNOTSUPP, "not supported")
    monkeypatch.setattr(disk_slots, "punch_hole", refuse)
    tier = DiskTier(tmp_path, 32 * MB, fsync=False)
    # Deleting past the slack twice: one warning, one try, every block still stored and read as before.
    with caplog.at_level(logging.WARNING, logger="tiers.disk_space"):
        for tag in ("a", "b"):
            hs = [key(tag, i) for i in range(256)]
            assert all(tier.put_many(hs, [block(64 << 10, i) for i in range(256)]))
            tier.delete_many(hs)
    assert len(calls) == 1 and sum("keep their disk space" in r.message for r in caplog.records) == 1
    assert all(tier.put_many([key("c", 0)], [block(64 << 10, 3)]))
    assert torch.equal(tier.get_many([key("c", 0)])[0], block(64 << 10, 3))
    tier.close()


class RebuildWhilePunching:
    """Segments whose punch sees the index rebuilt meanwhile (a heal)."""

    def __init__(self, space: FreeSlots) -> None:
        self.space, self.root = space, Path("/nowhere")

    def punch(self, c: int, slots) -> int:
        self.space.rebuilt({c: 100}, {c: set(slots)}, opening=False)
        return 0


def test_slots_a_rebuild_indexed_while_their_space_was_given_back_are_not_handed_out():
    # 100 free slots of 4 KiB, far past a slack of 8 KiB.
    space = FreeSlots({4096: 100})
    space.walked()
    for s in range(100):
        space.give(4000, s)
    # The index is rebuilt while their space goes back, and names them all.
    space.reclaim(RebuildWhilePunching(space), 8192)
    # None of the slots given back is handed out again: new blocks go past the mark.
    assert space.take_many([4000] * 3)[-1] >= 100
