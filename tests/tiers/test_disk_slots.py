"""DiskTier's slots over their lifetime: a slot written but never indexed, holes
left by deletes, a segment file cut short, and the older one-file-per-block
layout found on open."""
from __future__ import annotations

import os

import torch

from tests.tiers.disk_writer_child import block_for, key_for
from tiers.disk import DiskTier

MB = 1 << 20


def same_size_keys(pool: int) -> list[bytes]:
    """Those of the first `pool` keys whose blocks are as large as the first one's (so they share a slot size)."""
    size = block_for(key_for(0, 0)).numel()
    return [k for k in (key_for(0, i) for i in range(pool)) if block_for(k).numel() == size]


def test_a_slot_written_but_never_indexed_is_free_after_a_crash(tmp_path):
    tier = DiskTier(tmp_path, 8 * MB)
    held, orphan, new = same_size_keys(64)[:3]
    tier.put_many([held], [block_for(held)])
    # A put that wrote its slot and died before its index commit.
    obj = memoryview(block_for(orphan).numpy())
    slot = tier.space.take(len(obj))
    tier.segments.write(orphan, obj, slot, 0)
    orphan_place = tier.segments.located(len(obj), slot)
    tier.close()
    reopened = DiskTier(tmp_path, 8 * MB)
    # The orphan is not a block; its slot is the next one handed out.
    assert reopened.keys() == [held] and reopened.get_many([orphan]) == [None]
    assert reopened.put_many([new], [block_for(new)]) == [True]
    assert reopened.location_of(new)[:2] == orphan_place
    assert torch.equal(reopened.get_many([new])[0], block_for(new))
    reopened.close()


def test_slots_deleted_before_a_reopen_are_handed_out_after_its_walk(tmp_path):
    tier = DiskTier(tmp_path, 8 * MB, fsync=False)
    hs = same_size_keys(600)[:6]
    tier.put_many(hs[:4], [block_for(h) for h in hs[:4]])
    freed = tier.location_of(hs[1])
    tier.delete_many([hs[1]])
    tier.close()
    # Reopened: the sweep walks the index and finds the hole deleting hs[1] left.
    reopened = DiskTier(tmp_path, 8 * MB, fsync=False)
    assert reopened.swept.wait(30)
    reopened.put_many([hs[4]], [block_for(hs[4])])
    assert reopened.location_of(hs[4]) == freed
    # The next one goes past the last slot; every block reads back exact.
    reopened.put_many([hs[5]], [block_for(hs[5])])
    assert reopened.location_of(hs[5]) not in {reopened.location_of(h) for h in hs[:5]}
    got = reopened.get_many(hs)
    assert got[1] is None and all(torch.equal(g, block_for(h)) for g, h in zip(got, hs) if h != hs[1])
    reopened.close()


def test_the_sweep_drops_entries_whose_slot_lies_past_the_end_of_its_file(tmp_path):
    tier = DiskTier(tmp_path, 8 * MB)
    fine, gone, short = same_size_keys(64)[:3]
    for h in (fine, gone, short):
        tier.put_many([h], [block_for(h)])
    path, off, _ = tier.location_of(gone)
    tier.close()
    os.truncate(path, off + 10)  # the file cut short in gone's slot: gone and short lie past its end
    # Before the sweep gets to them, reading them is a miss, never wrong bytes.
    reopened = DiskTier(tmp_path, 8 * MB)
    assert reopened.get_many([gone, short])[1] is None or not reopened.swept.is_set()
    # The sweep drops what is left of them: only the intact block remains.
    assert reopened.swept.wait(30)
    assert reopened.keys() == [fine]
    assert reopened.location_of(short) is None
    assert reopened.stats.used_bytes == block_for(fine).numel() == 8 * MB - reopened.free_bytes()
    reopened.close()


def test_a_directory_of_the_one_file_per_block_layout_is_set_aside_and_removed(tmp_path):
    # What an earlier version left: data/<hash hex> files and their index.
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / key_for(0, 0).hex()).write_bytes(b"x" * 100)
    (tmp_path / "index.lmdb").mkdir()
    tier = DiskTier(tmp_path, 8 * MB)
    # The tier starts empty in its own layout and works; the sweep removes the old one.
    assert tier.keys() == [] and tier.put_many([key_for(0, 0)], [block_for(key_for(0, 0))]) == [True]
    assert tier.swept.wait(30)
    assert not (tmp_path / "data").exists() and not list(tmp_path.glob("*old-layout*"))
    tier.close()
