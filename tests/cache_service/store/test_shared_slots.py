"""Direct puts into a shared top tier: reserve makes room as a put does,
commit checks and publishes, and the blocks then live like any other."""
from __future__ import annotations

import threading

import pytest

from cache_service.store.shared_slots import HELD, NO_ROOM
from cache_service.blocks.objects import HEADER_SIZE, encode_objects, object_size
from tiers.types import CorruptBlockError
from tests.cache_service.store.store_helpers import NS, all_same, hashes, make_store, payload_for, same, write_flushed


def _direct(store, hs) -> list[int]:
    """What a same-host client does: reserve, encode the objects in, commit."""
    slots = store.reserve(NS, hs)
    todo = [(h, s) for h, s in zip(hs, slots) if s >= 0]
    todo_hs, todo_slots = [h for h, _ in todo], [s for _, s in todo]
    encode_objects(store.tiers[0].rows, todo_slots, NS, todo_hs, [payload_for(h) for h in todo_hs])
    assert store.commit(NS, todo_hs, NS, todo_hs, todo_slots) == len(todo)
    return slots


def test_committed_blocks_load_and_reach_the_tier_below(tmp_path):
    with make_store(tmp_path, cpu_blocks=8, shared=True) as store:
        # what the client encoded is published: loads verify and return it
        hs = hashes(6)
        assert min(_direct(store, hs)) >= 0
        assert store.lookup(hs) == 6 and all_same(store.load(NS, hs), hs)
        # write-through: the disk tier gets them too
        assert store.flush(60) and store.tiers[1].contains_many(hs) == [True] * 6


def test_reserve_evicts_like_a_put_and_skips_held_blocks(tmp_path):
    with make_store(tmp_path, cpu_blocks=4, shared=True) as store:
        old = hashes(4, start=100)
        write_flushed(store, old)
        # a held block gets no slot; making room for the rest sends victims down, not away
        slots = _direct(store, [old[3], *hashes(2)])
        assert slots[0] == HELD and min(slots[1:]) >= 0
        assert store.stats()["cpu"]["evictions"] == 2 and store.lookup(old) == 4
        assert all_same(store.load(NS, old), old)


def test_a_pool_full_of_pinned_blocks_has_no_room(tmp_path):
    with make_store(tmp_path, cpu_blocks=2, shared=True) as store:
        pinned = hashes(2, start=200)
        store.store(NS, pinned, [payload_for(h) for h in pinned])
        store.pins.pin(pinned)
        assert store.reserve(NS, hashes(2)) == [NO_ROOM, NO_ROOM]


def test_a_commit_of_slots_never_written_is_refused_and_hands_them_back(tmp_path):
    with make_store(tmp_path, cpu_blocks=4, shared=True) as store:
        # the slots still hold another block's object: that header is not theirs
        first = hashes(2, start=400)
        _direct(store, first)
        assert store.flush(60)  # written through: their slots are no longer held
        store.delete(first)
        hs = hashes(2)
        slots = store.reserve(NS, hs)
        with pytest.raises(CorruptBlockError, match="expected"):
            store.commit(NS, hs, NS, hs, slots)
        assert store.lookup(hs) == 0 and store.tiers[0].free_bytes() == 4 * store.tiers[0].slot_bytes


def test_slots_not_committed_are_handed_back(tmp_path):
    with make_store(tmp_path, cpu_blocks=4, shared=True) as store:
        slots = store.reserve(NS, hashes(3))
        assert store.tiers[0].free_bytes() == store.tiers[0].slot_bytes
        store.unreserve(slots)
        assert store.tiers[0].free_bytes() == 4 * store.tiers[0].slot_bytes and store.lookup(hashes(3)) == 0


def test_only_a_shared_top_tier_takes_direct_puts(tmp_path):
    with make_store(tmp_path, shared=False) as store:
        assert store.shared_pool() is None
        with pytest.raises(AssertionError):
            store.reserve(NS, hashes(1))


def gated(disk) -> threading.Event:
    """Make `disk`'s writes wait until the returned event is set."""
    gate, real_put = threading.Event(), disk.put_many
    disk.put_many = lambda hs, objs: (gate.wait(30), real_put(hs, objs))[1]
    return gate


def test_write_through_copies_committed_slots_so_their_slots_are_free_at_once(tmp_path):
    with make_store(tmp_path, cpu_blocks=2, shared=True) as store:
        disk, gate = store.tiers[1], gated(store.tiers[1])
        # two blocks committed: their write-through to disk waits at the gate
        first = hashes(2, start=600)
        _direct(store, first)
        # two more need room: the first two are evicted and their slots handed out again at once
        assert min(_direct(store, hashes(2, start=700))) >= 0
        # the disk gets the first two byte for byte, from the copies taken at the commit
        gate.set()
        assert store.flush(60) and disk.contains_many(first) == [True, True]
        assert all_same(store.load(NS, first), first)


def test_a_slot_the_client_writes_after_its_commit_never_reaches_the_disk(tmp_path):
    with make_store(tmp_path, cpu_blocks=4, shared=True) as store:
        gate = gated(store.tiers[1])
        # two blocks committed; the client then writes their slots again, before the disk writes them
        hs = hashes(2, start=900)
        slots = _direct(store, hs)
        for s in slots:
            store.tiers[0].rows[s, HEADER_SIZE:object_size(NS)].fill_(0x3c)
        gate.set()
        assert store.flush(60)
        # the pool's copies fail their check on load: each block is a miss or the committed bytes
        assert all(g is None or same(g, payload_for(h)) for g, h in zip(store.load(NS, hs), hs))
    # after a restart (the pool is empty) the disk serves the bytes committed, not the ones written after
    with make_store(tmp_path, cpu_blocks=4, shared=True) as store:
        assert all_same(store.load(NS, hs), hs)


def test_blocks_the_tiers_below_hold_already_are_not_copied_at_commit(tmp_path, monkeypatch):
    import cache_service.store.shared_slots as shared_slots

    with make_store(tmp_path, cpu_blocks=8, shared=True) as store:
        hs = hashes(6, start=1200)
        _direct(store, hs)
        assert store.flush(60) and store.tiers[1].contains_many(hs) == [True] * 6
        # The blocks leave the pool and are committed again: the disk holds them, so none is copied for it.
        store.tiers[0].delete_many(hs)
        copied = []
        real = shared_slots.copy_hashed
        monkeypatch.setattr(shared_slots, "copy_hashed", lambda d, s, skip: (copied.append(len(s)), real(d, s, skip))[1])
        _direct(store, hs)
        assert sum(copied) == 0 and all_same(store.load(NS, hs), hs)


def test_a_tier_below_failing_at_commit_leaves_no_slot_held(tmp_path):
    with make_store(tmp_path, cpu_blocks=8, shared=True) as store:
        pool, disk = store.tiers[0], store.tiers[1]
        real = disk.contains_many

        def failing_once(hs):  # the disk's presence check fails once (an lmdb read error)
            disk.contains_many = real
            raise OSError("read failed")
        disk.contains_many = failing_once
        with pytest.raises(OSError):
            _direct(store, hashes(6, start=1500))
        # The commit failed past its publication: every slot it held for the tiers below is let go.
        assert not any(pool._readers.values())
