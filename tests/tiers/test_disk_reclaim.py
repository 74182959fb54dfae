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
from tiers.disk_geometry import slot_size
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


def stored_and_deleted(tier: DiskTier, tag: str) -> None:
    """256 blocks of 64 KiB stored, then deleted: their slots are free."""
    hs = [key(tag, i) for i in range(256)]
    assert all(tier.put_many(hs, [block(64 << 10, i) for i in range(256)]))
    tier.delete_many(hs)


def fallocations(monkeypatch) -> list[int]:
    """The lengths the tier asks the filesystem to allocate from now on (still allocated)."""
    filled: list[int] = []
    real = os.posix_fallocate
    monkeypatch.setattr(os, "posix_fallocate", lambda fd, off, n: (filled.append(n), real(fd, off, n)))
    return filled


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


def fill_past_capacity(tier: DiskTier, tag: str) -> list[bytes]:
    """Blocks of another size (256 KiB) up to the tier's 32 MiB: with the free
    slots of the size deleted before, the files would hold ~1.5x the capacity."""
    hs = [key(tag, i) for i in range(122)]
    assert all(tier.put_many(hs, [block(256 << 10, i) for i in range(122)]))
    return hs


def test_deleted_blocks_leave_their_space_to_the_next_put_within_the_capacity(tmp_path, monkeypatch):
    # Blocks are stored and deleted: the files keep their space (the capacity is the tier's to hold).
    tier = DiskTier(tmp_path, 32 * MB, fsync=False)
    hs = [key("a", i) for i in range(256)]
    assert all(tier.put_many(hs, [block(64 << 10, i) for i in range(256)]))
    full = allocated(tier)
    tier.delete_many(hs)
    assert allocated(tier) == full
    # New blocks of that size are written into those slots as they are: nothing to allocate again.
    filled = fallocations(monkeypatch)
    again = [key("b", i) for i in range(256)]
    assert all(tier.put_many(again, [block(64 << 10, i + 1) for i in range(256)]))
    assert filled == [] and allocated(tier) == full
    assert all(torch.equal(g, block(64 << 10, i + 1)) for i, g in enumerate(tier.get_many(again)))
    tier.close()


def test_slots_given_back_are_allocated_again_before_they_are_written(tmp_path, monkeypatch):
    # Blocks of one size are stored and deleted, then blocks of another fill the capacity: the first
    # size's free slots give their space back.
    tier = DiskTier(tmp_path, 32 * MB, fsync=False)
    stored_and_deleted(tier, "a")
    before = allocated(tier)
    tier.delete_many(fill_past_capacity(tier, "big"))
    assert allocated(tier) < before + 32 * MB - 8 * MB
    # New blocks of the first size take those slots again, each allocated before its write.
    filled = fallocations(monkeypatch)
    again = [key("b", i) for i in range(256)]
    assert all(tier.put_many(again, [block(64 << 10, i + 1) for i in range(256)]))
    assert sum(filled) >= 150 * (64 << 10)
    # They read back whole, in this process and after a reopen.
    assert all(torch.equal(g, block(64 << 10, i + 1)) for i, g in enumerate(tier.get_many(again)))
    tier.close()
    tier = DiskTier(tmp_path, 32 * MB, fsync=False)
    assert all(torch.equal(g, block(64 << 10, i + 1)) for i, g in enumerate(tier.get_many(again)))
    tier.close()


def test_a_hole_the_full_disk_cannot_fill_fails_its_put_and_loses_no_slot(tmp_path, monkeypatch):
    # Slots given back (another size filled the capacity), then the filesystem refuses to allocate them again.
    tier = DiskTier(tmp_path, 32 * MB, fsync=False)
    stored_and_deleted(tier, "a")
    big = fill_past_capacity(tier, "big")
    kept = tier.space.spare_bytes() // slot_size(64 << 10)
    assert 0 < kept < 128
    tier.delete_many(big)

    def full(fd, off, n):
        raise OSError(errno.ENOSPC, "full")
    monkeypatch.setattr(os, "posix_fallocate", full)
    # Puts take the free slots that kept their space; those into holes are refused (a full disk).
    done = tier.put_many([key("b", i) for i in range(256)], [block(64 << 10, i) for i in range(256)])
    assert sum(done) == kept
    # The slots refused are holes still: the next put into one is refused again, not written unallocated.
    assert tier.put_many([key("d", 0)], [block(64 << 10, 2)]) == [False]
    # Once the disk has room, the same slots are handed out and written.
    monkeypatch.undo()
    again = [key("c", i) for i in range(256 - kept)]
    assert all(tier.put_many(again, [block(64 << 10, i) for i in range(len(again))]))
    assert tier.space.marks[slot_size(64 << 10)] == 256
    tier.close()


def test_a_filesystem_that_cannot_punch_holes_keeps_the_space_and_says_so_once(tmp_path, monkeypatch, caplog):
    # Punching holes is refused (EOPNOTSUPP) by this filesystem.
    calls = []

    def refuse(fd, off, n):
        calls.append(n)
        raise OSError(errno.EOPNOTSUPP, "not supported")
    monkeypatch.setattr(disk_slots, "punch_hole", refuse)
    tier = DiskTier(tmp_path, 32 * MB, fsync=False)
    # Free slots past the capacity twice: one warning, one try, every block still stored and read as before.
    with caplog.at_level(logging.WARNING, logger="tiers.disk_space"):
        for tag in ("a", "b"):
            stored_and_deleted(tier, tag)
            tier.delete_many(fill_past_capacity(tier, f"big-{tag}"))
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
    # 100 free slots of 4 KiB, found free by the walk.
    space = FreeSlots({4096: 100})
    assert space.walked() == 100
    # The index is rebuilt while all their space goes back (past a capacity and a slack of none), and names them all.
    space.reclaim(RebuildWhilePunching(space), 0, 0)
    # None of the slots given back is handed out again: new blocks go past the mark.
    assert space.take_many([4000] * 3)[-1] >= 100


class CountingPunches:
    """Segments whose punch records what it was handed (and may run a nested reclaim, as a
    concurrent put's or delete's would run beside it)."""

    def __init__(self, space: FreeSlots, nested=None) -> None:
        self.space, self.root, self.nested, self.punched = space, Path("/nowhere"), nested, []

    def punch(self, c: int, slots) -> int:
        self.punched += [c] * len(slots)
        if self.nested:
            self.nested, nested = None, self.nested
            nested()
        return c * len(slots)


def test_a_full_tier_evicting_keeps_its_free_slots_whatever_its_slots_overhead():
    # 1,000 slots of 36 KiB hold 32 KiB objects (12% header and rounding): a full tier of 32 MB.
    space = FreeSlots({36864: 1000})
    space.walked()
    space.take_many([32768] * 1000)
    # 64 blocks are evicted: the room they leave is what the next put fills.
    for s in range(64):
        space.give(32768, s)
    segs = CountingPunches(space)
    assert space.reclaim(segs, 4 << 20, 64 * 32768) == 0 and segs.punched == []


def test_space_goes_back_from_the_size_written_least_recently_and_a_reclaim_beside_it_cuts_no_more():
    # An old size (100 free slots, none taken since the open) and the size in use (90 of 100 taken, 10 free).
    space = FreeSlots({65536: 100, 16384: 100})
    space.walked()
    space.take_many([16000] * 90)
    # No room left: the free slots hold 7.7 MiB past a slack of 1 MiB; a second reclaim runs during the punch.
    segs = CountingPunches(space)
    segs.nested = lambda: space.reclaim(segs, 1 << 20, 0)
    space.reclaim(segs, 1 << 20, 0)
    # Only the old size's slots went back, as many as the excess needs, once.
    assert set(segs.punched) == {65536} and len(segs.punched) == -(-(100 * 65536 + 10 * 16384 - (1 << 19)) // 65536)
    assert space.spare_bytes() <= (1 << 19) + 65536


def test_after_a_restart_the_free_slots_of_the_size_in_use_keep_their_space(tmp_path, monkeypatch):
    # An old size was given back; blocks of another fill the capacity, and a third of them are evicted.
    tier = DiskTier(tmp_path, 32 * MB, fsync=False)
    stored_and_deleted(tier, "a")
    big = fill_past_capacity(tier, "big")
    tier.delete_many(big[:40])
    tier.close()
    # Reopened (the holes given back are not known now) and swept.
    tier = DiskTier(tmp_path, 32 * MB, fsync=False)
    assert tier.swept.wait(60)
    # New blocks of the size in use go into its free slots as they are: nothing to allocate again.
    filled = fallocations(monkeypatch)
    again = [key("c", i) for i in range(40)]
    assert all(tier.put_many(again, [block(256 << 10, i) for i in range(40)]))
    assert filled == []
    tier.close()


def test_a_closed_tier_gives_nothing_back(tmp_path, monkeypatch):
    # (a put's or delete's reclaim that runs after close would reopen and punch the files)
    tier = DiskTier(tmp_path, 32 * MB, fsync=False)
    assert all(tier.put_many([key("a", 0)], [block(64 << 10, 0)]))
    tier.close()
    calls = []
    monkeypatch.setattr(FreeSlots, "reclaim", lambda *a: calls.append(a))
    tier.reclaim()
    assert calls == []


def test_a_batch_takes_its_free_slots_in_file_order():
    # (slots freed last first, taken as they come, made every other round of a store write its file backwards)
    space = FreeSlots({69632: 10})
    space.walked()
    space.take_many([65536] * 10)
    for s in (3, 7, 1, 8, 5):
        space.give(65536, s)
    # A batch of seven: the five free slots in file order, then two past the mark.
    assert space.take_many([65536] * 7) == [1, 3, 5, 7, 8, 10, 11]


def test_an_old_size_gives_its_space_back_before_the_size_now_written_even_with_more_blocks_in_use():
    # A model switch half way: the old size has 2,000 blocks in use and 800 free, the new one 30 and 10.
    space = FreeSlots({})
    space.take_many([32768] * 2800)
    for s in range(800):
        space.give(32768, s)
    space.take_many([1 << 20] * 40)
    for s in range(10):
        space.give(1 << 20, s)
    # 12 MiB of room left: the free slots hold ~26 MiB past it. Only the old size's go back.
    segs = CountingPunches(space)
    space.reclaim(segs, 1 << 20, 12 << 20)
    assert segs.punched and set(segs.punched) == {36864}


def test_an_emptied_tier_reopened_still_gives_back_what_another_size_needs(tmp_path):
    # A tier full of one size, every block deleted, closed: its index is empty, its files are not. (Its
    # check finds every object whole, as the store's does for block objects: a rebuild keeps the files.)
    whole = lambda h, obj: True  # noqa: E731
    tier = DiskTier(tmp_path, 32 * MB, fsync=False, check=whole)
    hs = [key("a", i) for i in range(450)]
    assert all(tier.put_many(hs, [block(64 << 10, i) for i in range(450)]))
    tier.delete_many(hs)
    tier.close()
    # Reopened (the index is rebuilt from the slots), then filled with another size.
    tier = DiskTier(tmp_path, 32 * MB, fsync=False, check=whole)
    assert tier.swept.wait(60)
    fill_past_capacity(tier, "big")
    # The old size's slots gave their space back: the files hold the capacity, the slack and a step ahead per size.
    assert allocated(tier) <= 32 * MB + 3 * tier.segments.step + MB, allocated(tier) / MB
    tier.close()
