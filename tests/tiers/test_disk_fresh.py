"""The disk tier's fresh records (tiers/disk_fresh.py): puts indexed in
memory and merged into lmdb many at a time, and what a stop without a
clean close leaves: a dirty index whose unindexed slots the sweep reads
and indexes again, byte-exact, while new puts go elsewhere."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.tiers.disk_writer_child import block_for, key_for
from tiers import disk_fresh, disk_sweep
from tiers.disk import DiskTier
from tiers.types import TierKVError

REPO = Path(__file__).resolve().parents[2]
MB = 1 << 20


def keys(n: int, seed: int = 0) -> list[bytes]:
    return [key_for(seed, i) for i in range(n)]


def exact(tier: DiskTier, hs: list[bytes]) -> bool:
    return all(g is not None and torch.equal(g, block_for(h)) for g, h in zip(tier.get_many(hs), hs))


def stopped_without_close(root: Path, n: int, fsync: bool = True) -> None:
    """A process that puts n blocks (seed 0) and exits without closing the tier (a crash, as lmdb sees it)."""
    code = (f"import os; from tiers.disk import DiskTier; from tests.tiers.test_disk_fresh import block_for, keys\n"
            f"t = DiskTier({str(root)!r}, 64 << 20, fsync={fsync})\n"
            f"hs = keys({n})\nassert all(t.put_many(hs, [block_for(h) for h in hs]))\nos._exit(0)\n")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_puts_are_merged_into_the_index_many_at_a_time(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_fresh, "MERGE_RECORDS", 50)
    tier = DiskTier(tmp_path, 64 * MB)
    hs = keys(80)
    # 40 blocks: indexed in memory only, lmdb holds none of them; reads and counts see them all.
    assert all(tier.put_many(hs[:40], [block_for(h) for h in hs[:40]]))
    assert tier.index.records() == 0 and tier.stats.blocks == 40 and exact(tier, hs[:40])
    # 40 more: past the merge size, all 80 go into lmdb in one transaction.
    assert all(tier.put_many(hs[40:], [block_for(h) for h in hs[40:]]))
    assert tier.index.records() == 80 and len(tier._fresh) == 0 and tier.stats.blocks == 80
    # A fresh block deleted is gone at once, and its slot is the next one handed out.
    pool = keys(200, seed=1)
    more = [h for h in pool if block_for(h).numel() == block_for(pool[0]).numel()][:2]  # one slot size
    tier.put_many(more[:1], [block_for(more[0])])
    slot = tier.location_of(more[0])
    assert tier.delete_many(more[:1]) == 1 and tier.get_many(more[:1]) == [None]
    tier.put_many(more[1:], [block_for(more[1])])
    assert tier.location_of(more[1])[:2] == slot[:2] and tier.stats.blocks == 81
    tier.close()
    # A clean close merges the rest and clears the dirty flag: the next open has nothing to recover.
    tier = DiskTier(tmp_path, 64 * MB)
    assert not tier.recovering and tier.index.records() == 81 and exact(tier, hs + more[1:])
    tier.close()


def test_blocks_put_before_a_stop_without_close_are_indexed_again(tmp_path):
    stopped_without_close(tmp_path, 30)
    # Reopened: the index is dirty and names none of the 30; the sweep finds them in their slots.
    tier = DiskTier(tmp_path, 64 * MB)
    assert tier.recovering and tier.stats.recovering == 1
    assert tier.swept.wait(60)
    assert not tier.recovering and tier.stats.recovering == 0
    hs = keys(30)
    assert tier.stats.blocks == 30 and exact(tier, hs)
    tier.close()
    # The close after the recovery was clean, and its slot marks cover the slots it indexed again:
    # new puts go past them, and every block reads back exact.
    tier = DiskTier(tmp_path, 64 * MB)
    assert not tier.recovering and exact(tier, hs)
    new = keys(30, seed=3)
    assert all(tier.put_many(new, [block_for(h) for h in new]))
    assert exact(tier, hs) and exact(tier, new) and tier.stats.corrupt == 0
    tier.close()


def test_while_recovering_new_puts_leave_the_unindexed_slots_alone(tmp_path, monkeypatch):
    stopped_without_close(tmp_path, 30)
    # The sweep held back: a put before the recovery takes slots past every written one.
    gate = threading.Event()
    monkeypatch.setattr(DiskTier, "learn", lambda self, after, _learn=DiskTier.learn: gate.wait(60) and _learn(self, after))
    tier = DiskTier(tmp_path, 64 * MB)
    new = keys(10, seed=2)
    assert all(tier.put_many(new, [block_for(h) for h in new]))
    gate.set()
    assert tier.swept.wait(60) and not tier.recovering
    # The 30 from before the stop and the 10 put since all read back exact.
    assert exact(tier, keys(30)) and exact(tier, new) and tier.stats.blocks == 40
    tier.close()


def test_a_damaged_unindexed_slot_is_not_indexed_and_is_free_again(tmp_path):
    stopped_without_close(tmp_path, 20)
    # One of the slots the stop left unindexed has a flipped byte in its object.
    seg = sorted((tmp_path / "segments").iterdir())[0]
    with open(seg, "r+b") as f:
        f.seek(32 + 100)  # the first slot's object (after its 32-byte header)
        b = f.read(1)
        f.seek(32 + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    tier = DiskTier(tmp_path, 64 * MB)
    assert tier.swept.wait(60)
    # 19 whole blocks come back; the damaged one is a miss, never a wrong block.
    hs = keys(20)
    got = tier.get_many(hs)
    assert sum(g is None for g in got) == 1 and tier.stats.blocks == 19
    assert all(g is None or torch.equal(g, block_for(h)) for g, h in zip(got, hs))
    tier.close()


def test_the_dirty_flag_is_synced_with_its_meta_page_before_the_first_fresh_record(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, 64 * MB)
    synced = []
    monkeypatch.setattr(tier.index, "sync", lambda: synced.append(tier.index.dirty()))
    # The first put sets the flag and syncs the whole index (lmdb leaves a commit's meta page to the next one);
    # later puts add fresh records without another index write.
    hs = keys(6)
    tier.put_many(hs[:3], [block_for(h) for h in hs[:3]])
    tier.put_many(hs[3:], [block_for(h) for h in hs[3:]])
    assert synced == [True]
    tier.close()


def test_a_put_that_loses_a_race_with_close_is_not_reported_stored(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, 64 * MB)
    assert tier.swept.wait(30)
    first, h = keys(2)
    assert tier.put_many([first], [block_for(first)]) == [True]  # the dirty flag is set: later puts write no index
    commit = tier._commit

    def close_meanwhile(written):  # the slots are written, then the tier closes before the records exist
        tier.close()
        return commit(written)

    monkeypatch.setattr(tier, "_commit", close_meanwhile)
    with pytest.raises(TierKVError):
        tier.put_many([h], [block_for(h)])
    # The close was clean and the block was never indexed: the next open neither has it nor recovers anything.
    tier = DiskTier(tmp_path, 64 * MB)
    assert not tier.recovering and tier.get_many([h]) == [None] and tier.stats.blocks == 1 and exact(tier, [first])
    tier.close()


def test_a_slot_the_index_already_names_for_its_block_is_kept_as_it_is(tmp_path):
    stopped_without_close(tmp_path, 5)
    tier = DiskTier(tmp_path, 64 * MB)
    assert tier.swept.wait(60)
    hs = keys(5)
    # Met again by a recovery (as after a heal that indexed every slot): the same copy, not a second one.
    size, csum, slot, _ = tier.records_of(hs[:1])[0]
    with tier.commit_lock:
        assert tier._recover_some([(hs[0], size, csum, slot)]) == (True, 0)
    assert exact(tier, hs) and tier.stats.corrupt == 0
    tier.close()



def same_size_put(tier: DiskTier, like: bytes, seed: int):
    """Where a new block as large as `like`'s object lands (a free slot of that size, last freed first)."""
    h = keys(1, seed=seed)[0]
    assert tier.put_many([h], [torch.full((block_for(like).numel(),), 7, dtype=torch.uint8)]) == [True]
    return tier.location_of(h)


def test_a_block_deleted_before_the_walk_reaches_it_stays_deleted(tmp_path, monkeypatch):
    stopped_without_close(tmp_path, 30)
    # The sweep held back: ten of the blocks from before the stop are deleted before it indexes them again.
    gate = threading.Event()
    monkeypatch.setattr(DiskTier, "learn", lambda self, after, _learn=DiskTier.learn: gate.wait(60) and _learn(self, after))
    tier = DiskTier(tmp_path, 64 * MB)
    tier.delete_many(keys(10))
    gate.set()
    # Once the walk is over they are still gone (no record, no read), and the other twenty read back exact.
    assert tier.swept.wait(60) and not tier.recovering
    assert tier.contains_many(keys(10)) == [False] * 10 and tier.get_many(keys(10)) == [None] * 10
    assert exact(tier, keys(30)[10:]) and tier.stats.blocks == 20
    tier.close()


def test_the_walk_indexes_no_more_than_the_capacity_leaves(tmp_path, monkeypatch):
    stopped_without_close(tmp_path, 30)
    new = keys(10, seed=3)
    capacity = sum(block_for(h).numel() for h in new + keys(10))
    # reopened with room for about 20 blocks, the sweep held back while 10 new ones are put
    gate = threading.Event()
    monkeypatch.setattr(DiskTier, "learn", lambda self, after, _learn=DiskTier.learn: gate.wait(60) and _learn(self, after))
    tier = DiskTier(tmp_path, capacity)
    assert all(tier.put_many(new, [block_for(h) for h in new]))
    gate.set()
    # the walk indexes what fits of the 30 from before the stop, not all: the tier stays within its capacity
    assert tier.swept.wait(60) and not tier.recovering
    assert tier.stats.used_bytes <= capacity and exact(tier, new)
    assert 5 <= sum(tier.contains_many(keys(30))) < 20
    tier.close()


def test_a_recovery_the_index_refused_is_tried_again(tmp_path, monkeypatch):
    stopped_without_close(tmp_path, 30)
    # the disk refuses the walk's index write once (a full disk: a failed write, not damage)
    monkeypatch.setattr(disk_sweep, "RECOVER_RETRY_S", 0.2)
    refused, write = [], DiskTier._write_index

    def refuse_once(self, puts, dels, *args, **kw):
        if puts and self.recovering and not refused:
            refused.append(len(puts))
            return False
        return write(self, puts, dels, *args, **kw)

    monkeypatch.setattr(DiskTier, "_write_index", refuse_once)
    tier = DiskTier(tmp_path, 64 * MB)
    assert tier.swept.wait(60) and refused
    # deletes of blocks that have records are not remembered as early ones meanwhile
    tier.put_many(keys(5, seed=6), [block_for(h) for h in keys(5, seed=6)])
    tier.delete_many(keys(5, seed=6))
    assert not tier._deleted_early
    # the sweep's thread tries again: the thirty from before the stop are indexed, the recovery ends
    for _ in range(100):
        if not tier.recovering:
            break
        time.sleep(0.1)
    assert not tier.recovering and tier.stats.recovering == 0 and exact(tier, keys(30))
    tier.close()


def test_a_recovered_block_deleted_before_the_walks_end_frees_its_slot(tmp_path, monkeypatch):
    stopped_without_close(tmp_path, 6)
    # The recovery indexes the six; one is deleted before the walk's end frees the slots no one uses.
    recover, hs, where = DiskTier.recover, keys(6), []

    def recover_then_delete(self, holes):
        n = recover(self, holes)
        where.append(self.location_of(hs[0]))
        self.delete_many(hs[:1])
        return n

    monkeypatch.setattr(DiskTier, "recover", recover_then_delete)
    tier = DiskTier(tmp_path, 64 * MB)
    assert tier.swept.wait(60) and not tier.recovering and tier.stats.blocks == 5
    # Its slot is free: the next put of that size takes it, and the others read back exact.
    assert where[0] is not None and same_size_put(tier, hs[0], seed=4) == where[0]
    assert exact(tier, hs[1:])
    tier.close()


def test_a_delete_the_index_refuses_removes_nothing(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, 64 * MB)
    assert tier.swept.wait(30)
    old, new = keys(2)
    tier.put_many([old], [block_for(old)])
    tier.merge()  # old's record is in lmdb; new's stays fresh
    tier.put_many([new], [block_for(new)])
    where = tier.location_of(new)
    # lmdb refuses the delete (its map full): neither block is removed, both read back.
    monkeypatch.setattr(tier.index, "write", lambda *a, **k: False)
    assert tier.delete_many([old, new]) == 0 and exact(tier, [old, new])
    # Once it accepts, both go, and new's slot is free for the next put of its size.
    monkeypatch.undo()
    assert tier.delete_many([old, new]) == 2 and tier.contains_many([old, new]) == [False, False]
    assert same_size_put(tier, new, seed=5) == where
    tier.close()


def test_fresh_records_are_merged_once_they_describe_enough_bytes(tmp_path, monkeypatch):
    # Few records of large objects: merged by their bytes, which bound what a crash leaves the sweep to read.
    hs = keys(12)
    size = sum(block_for(h).numel() for h in hs[:5])
    monkeypatch.setattr(disk_fresh, "MERGE_BYTES", size)
    tier = DiskTier(tmp_path, 64 * MB)
    # Four objects: under the bytes, fresh.
    assert all(tier.put_many(hs[:4], [block_for(h) for h in hs[:4]]))
    assert tier.index.records() == 0 and len(tier._fresh) == 4
    # The fifth reaches them: all five go into lmdb.
    assert all(tier.put_many(hs[4:5], [block_for(hs[4])]))
    assert tier.index.records() == 5 and len(tier._fresh) == 0 and exact(tier, hs[:5])
    tier.close()


def tier_with_fresh_records(tmp_path) -> tuple[DiskTier, list]:
    """A swept tier and the 12 blocks it holds, their records fresh (in memory, not merged yet)."""
    tier = DiskTier(tmp_path, 64 * MB)
    assert tier.swept.wait(30)
    hs = keys(12)
    tier.put_many(hs, [block_for(h) for h in hs])
    return tier, hs


def test_a_merge_never_counts_a_block_twice(tmp_path, monkeypatch):
    tier, hs = tier_with_fresh_records(tmp_path)
    # Between a merge's commits and the fresh records' drop, the blocks are in both places: the tier's
    # totals (what eviction reads as used space) count them once all the same, after each transaction too.
    seen, merged, write = [], tier._fresh.merged, tier.index.write
    monkeypatch.setattr(tier._fresh, "merged", lambda part: seen.append(("dropped", tier.stats.blocks)) or merged(part))
    monkeypatch.setattr(tier.index, "write", lambda *a: write(*a) and not seen.append(("txn", tier.stats.blocks)))
    monkeypatch.setattr("tiers.disk_records.MERGE_TXN", 5)
    assert tier.merge()
    # Three transactions of at most 5, then the records are dropped from memory at once.
    assert seen == [("txn", 12)] * 3 + [("dropped", 12)]
    assert tier.stats.blocks == 12 and tier.index.records() == 12 and tier._fresh.totals() == (0, 0)
    assert tier.stats.used_bytes == sum(block_for(h).numel() for h in hs)
    tier.close()


def test_a_merge_the_index_refuses_midway_keeps_the_rest_fresh(tmp_path, monkeypatch):
    tier, hs = tier_with_fresh_records(tmp_path)
    # lmdb takes the first transaction of 5 records and refuses the second (its map full).
    calls, write = [], tier.index.write
    monkeypatch.setattr(tier.index, "write", lambda *a: calls.append(1) or (len(calls) == 1 and write(*a)))
    monkeypatch.setattr("tiers.disk_records.MERGE_TXN", 5)
    assert not tier.merge()
    # The 5 it took left memory; the 7 others stay fresh; every block is counted once and reads back.
    assert tier.index.records() == 5 and len(tier._fresh) == 7
    assert tier.stats.blocks == 12 and exact(tier, hs)
    # Once lmdb accepts again, the next merge takes the rest.
    monkeypatch.setattr(tier.index, "write", write)
    assert tier.merge() and tier.index.records() == 12 and len(tier._fresh) == 0 and exact(tier, hs)
    tier.close()
