"""Writes queued for the tiers below, against deletes, stores again, and
bytes a same-host client wrote into the shared pool: each queued write is
its own (a delete ends those queued so far, never one queued after it), a
delete wins over a write the writer has already taken, and payloads that do
not match their checksum never reach a tier that trusts what it is given."""
from __future__ import annotations

import threading

from cache_service.blocks.objects import HEADER_SIZE, encode_objects
from tests.cache_service.store.store_helpers import NS, hashes, make_store, payload_for, same


def _paused_writer(store, tier: int):
    """Pause the writer of `tier` as it starts its next put (it has taken
    its batch): (paused, go) events."""
    placement, put = store._placement, store._placement.put
    paused, go = threading.Event(), threading.Event()

    def pausing(i, items, *a, **kw):
        if i == tier and items and threading.current_thread().name.startswith("tierkv-writer") and not go.is_set():
            paused.set()
            assert go.wait(20)
        return put(i, items, *a, **kw)

    placement.put = pausing
    return paused, go


def test_a_delete_wins_over_a_write_the_writer_has_taken(tmp_path):
    store = make_store(tmp_path)
    h = hashes(1)
    # The block's write to disk is in the writer's hands when a delete comes.
    paused, go = _paused_writer(store, 1)
    store.store(NS, h, [payload_for(x) for x in h])
    assert paused.wait(20)
    assert store.delete(h) == 1
    go.set()
    assert store.flush(20)
    # The write did not bring it back.
    assert store.tiers[1].contains_many(h) == [False] and store.lookup(h) == 0
    store.close()


def test_a_write_ending_after_a_delete_does_not_cancel_the_next_store(tmp_path):
    store = make_store(tmp_path)
    store._state.writers[1]._batch = 1  # one write per batch: the order below is the writer's
    h, other = hashes(1), hashes(1, start=50)
    # The writer is busy with another block; h's write queues behind it, and h is deleted and stored again.
    paused, go = _paused_writer(store, 1)
    store.store(NS, other, [payload_for(x) for x in other])
    assert paused.wait(20)
    store.store(NS, h, [payload_for(other[0])])  # what h held before (say, another model's layout)
    store.delete(h)
    assert store.store(NS, h, [payload_for(x) for x in h]) == 1
    # The old write ends (as deleted); the new one still lands on disk, and survives a reopen.
    go.set()
    assert store.flush(20)
    assert store.tiers[1].contains_many(h) == [True]
    store.close()
    reopened = make_store(tmp_path)
    assert reopened.lookup(h) == 1 and same(reopened.load(NS, h)[0], payload_for(h[0]))
    reopened.close()


def test_a_shared_pool_payload_unlike_its_checksum_never_reaches_disk(tmp_path):
    store = make_store(tmp_path, cpu_blocks=8, shared=True)
    pool, h = store.tiers[0], hashes(1)
    # A client writes a block into the shared pool, then its bytes change (a bug, a late write):
    # the header is right, the payload no longer matches the header's checksum.
    slot = store.reserve(NS, h)[0]
    encode_objects(pool.rows, [slot], NS, h, [payload_for(h[0])])
    pool.rows[slot, HEADER_SIZE + 100] ^= 0xFF
    store.commit(NS, h, NS, h, [slot])
    assert store.flush(20)
    # It is not written through to disk (which would serve it as sound), and loads are misses.
    assert store.tiers[1].contains_many(h) == [False]
    assert store.load(NS, h) == [None] and store.lookup(h) == 0 and store.stats()["cpu"]["corrupt"] == 1
    store.close()
