"""The disk tier against other threads and a damaged index: the sweep or a
heal racing the store's writer, a close racing a put's slot writes, index
records that name slots not theirs, and lmdb refusing a write (the store
placement's side of these races: tests/cache_service/store/test_writes_in_flight.py)."""
from __future__ import annotations

import threading

import lmdb
import torch

from tests.tiers.disk_writer_child import block_for
from tests.tiers.test_disk import MB, keys, overwrite
from tests.tiers.test_disk_fresh import exact
from tiers.disk import DiskTier
from tiers.disk_index import RECORD
from tiers.types import TierKVError


def test_recheck_reports_blocks_another_thread_set_aside(tmp_path, monkeypatch):
    """The store's writer asks whether the tier still holds blocks sound
    (`recheck`) while the sweep quarantines damaged ones: a block the sweep
    took first is no longer held, and the writer must write it again."""
    tier = DiskTier(tmp_path, 8 * MB)
    a, b, c = keys(3)
    tier.put_many([a, b, c], [block_for(a), block_for(b), block_for(c)])
    overwrite(tier, a, b"\xff" * 16, at=40)
    overwrite(tier, c, b"\xff" * 16, at=40)
    # The writer saw a held; the sweep quarantined it before the recheck began.
    assert tier.contains_many([a]) == [True]
    tier.quarantine([a])
    assert tier.recheck([a, b]) == [a]
    # The sweep sets c aside between the writer's failed read and its own set-aside.
    real_read = tier._read

    def read_then_sweep(h, e, buf):
        got = real_read(h, e, buf)
        if got is None:
            tier._set_aside(h, e, force=True)
        return got

    monkeypatch.setattr(tier, "_read", read_then_sweep)
    assert tier.recheck([b, c]) == [c] and tier.contains_many([b, c]) == [True, False]
    # A block stored again between the failed read and the set-aside is held sound: not reported.
    tier.put_many([c], [block_for(c)])
    overwrite(tier, c, b"\xff" * 16, at=40)

    def read_then_reput(h, e, buf):
        got = real_read(h, e, buf)
        tier.delete_many([h])
        tier.put_many([h], [block_for(h)])
        return got

    monkeypatch.setattr(tier, "_read", read_then_reput)
    assert tier.recheck([c]) == []
    monkeypatch.undo()
    assert torch.equal(tier.get_many([c])[0], block_for(c))
    tier.close()


def test_close_waits_for_slot_writes_under_way(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, 8 * MB)
    assert tier.swept.wait(30)
    h = keys(1)[0]
    writing, go = threading.Event(), threading.Event()
    grown = tier.segments._grown

    def paused(placed):  # the put holds its files' descriptors and has not written yet
        fds = grown(placed)
        writing.set()
        assert go.wait(30)
        return fds

    monkeypatch.setattr(tier.segments, "_grown", paused)
    outcome = []
    put = threading.Thread(target=lambda: outcome.append(_put_or_error(tier, h)))
    put.start()
    assert writing.wait(30)
    # A close from another thread waits: it would close the descriptors the put writes through.
    closer = threading.Thread(target=tier.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive()
    go.set()
    put.join(30)
    closer.join(30)
    assert not closer.is_alive() and not put.is_alive()
    # The put either landed before the close (and reads back after a reopen) or was refused: never a write
    # into a closed or reused descriptor.
    reopened = DiskTier(tmp_path, 8 * MB)
    got = reopened.get_many([h])[0]
    assert outcome in ([[True]], ["closed"]) and (got is not None) == (outcome == [[True]])
    assert got is None or torch.equal(got, block_for(h))
    assert reopened.stats.corrupt == 0 and reopened.stats.errors == 0
    reopened.close()


def _put_or_error(tier: DiskTier, h):
    try:
        return tier.put_many([h], [block_for(h)])
    except TierKVError:
        return "closed"


def test_a_heal_during_a_delete_deletes_the_fresh_blocks_too(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, 8 * MB, check=lambda h, obj: True)  # a heal keeps every whole slot
    assert tier.swept.wait(30)
    old, new, later = keys(3)
    tier.put_many([old], [block_for(old)])
    tier.merge()  # old's record is in lmdb; new's is fresh
    tier.put_many([new], [block_for(new)])
    # The delete's lmdb write meets damage: the index is rebuilt from the slots (new's among them), then the
    # write is applied to the rebuilt one.
    write, failed = tier.index.write, []

    def damaged_once(*a, **k):
        if not failed:
            failed.append(1)
            raise lmdb.CorruptedError("a damaged page")
        return write(*a, **k)

    monkeypatch.setattr(tier.index, "write", damaged_once)
    assert tier.delete_many([old, new]) == 2
    monkeypatch.undo()
    # Both are gone from the rebuilt index as well, so their freed slots are no one's.
    assert tier.contains_many([old, new]) == [False, False] and tier.index.has_many([old, new]) == [False, False]
    tier.put_many([later], [block_for(later)])
    assert tier.get_many([old, new]) == [None, None] and exact(tier, [later]) and tier.stats.corrupt == 0
    tier.close()


def _damage_slot_field(tier: DiskTier, h, slot: int) -> None:
    """Index damage: h's record names `slot` (the rest of the record as it was)."""
    size, csum, _, t = tier.records_of([h])[0]
    with tier.index._env.begin(write=True) as txn:
        txn.put(h, RECORD.pack(size, csum, slot, t))


def test_a_record_naming_another_blocks_slot_frees_nothing(tmp_path):
    tier = DiskTier(tmp_path, 8 * MB)
    assert tier.swept.wait(30)
    a, b = keys(2)
    same = block_for(a).numel()
    tier.put_many([a, b], [block_for(a), torch.full((same,), 9, dtype=torch.uint8)])
    tier.merge()
    # a's record is damaged to name b's slot: a read of a is a miss, and b's slot stays b's.
    _damage_slot_field(tier, a, tier.records_of([b])[0][2])
    assert tier.get_many([a]) == [None] and tier.stats.corrupt == 1
    c = keys(1, seed=7)[0]
    tier.put_many([c], [torch.full((same,), 5, dtype=torch.uint8)])
    assert tier.records_of([c])[0][2] != tier.records_of([b])[0][2]
    assert torch.equal(tier.get_many([b])[0], torch.full((same,), 9, dtype=torch.uint8))
    tier.close()


def test_a_record_naming_a_slot_past_the_marks_does_not_free_it(tmp_path):
    tier = DiskTier(tmp_path, 8 * MB)
    h = keys(1)[0]
    tier.put_many([h], [block_for(h)])
    tier.merge()
    # Damage names a slot past every slot handed out; the sweep of the next open quarantines the record.
    _damage_slot_field(tier, h, tier.records_of([h])[0][2] + 3)
    tier.close()
    tier = DiskTier(tmp_path, 8 * MB)
    assert tier.swept.wait(30) and tier.get_many([h]) == [None]
    # The slot marks hand that slot out in their turn, once: five puts of the size take five slots.
    size = block_for(h).numel()
    more = keys(5, seed=8)
    for i, k in enumerate(more):
        tier.put_many([k], [torch.full((size,), i, dtype=torch.uint8)])
    slots = [tier.records_of([k])[0][2] for k in more]
    assert len(set(slots)) == 5
    assert all(torch.equal(g, torch.full((size,), i, dtype=torch.uint8)) for i, g in enumerate(tier.get_many(more)))
    tier.close()


def test_recheck_keeps_a_block_lmdb_will_not_unindex(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, 8 * MB)
    assert tier.swept.wait(30)
    h = keys(1)[0]
    tier.put_many([h], [block_for(h)])
    tier.merge()
    overwrite(tier, h, b"\xff" * 8, at=40)
    # lmdb refuses writes (map full): the damaged block cannot leave the index, so it is not reported as
    # taken out (the store would count a rewrite that cannot happen); reads stay misses, counted as errors.
    monkeypatch.setattr(tier.index, "write", lambda *a, **k: False)
    assert tier.recheck([h]) == [] and tier.stats.errors >= 1
    assert tier.get_many([h]) == [None] and tier.records_of([h])[0] is not None
    tier.close()
