"""A delete is final: no write the store started before it brings the block
back afterwards. Besides the writer's queue (test_writes_in_flight.py), two
paths carry a block's bytes from before a delete to a tier after it: the
retry tick (an outage's backlog, read from the upload journal or from the
tiers above) and a write-back victim (read out of the tier above, then
handed to the writer below). Each is paused here at its worst moment."""
from __future__ import annotations

import threading

from cache_service.store.deletes import DeleteLog
from cache_service.store.eviction import make_policy
from cache_service.store.tiered_store import TieredStore
from tests.cache_service.store.store_helpers import (NS, OBJ, FlakyDisk, hashes, make_store, payload_for, same, until,
                                                     write_flushed)
from tests.cache_service.store.test_journal import open_pair
from tiers.cpu import CpuTier


def _pause_after(obj, name: str, before: bool = False):
    """Pause the next call of obj.name after it returns (or `before` it
    runs): (paused, go) events."""
    real, paused, go = getattr(obj, name), threading.Event(), threading.Event()

    def pause() -> None:
        if not go.is_set():
            paused.set()
            assert go.wait(20)

    def pausing(*a, **kw):
        if before:
            pause()
        out = real(*a, **kw)
        if not before:
            pause()
        return out

    setattr(obj, name, pausing)
    return paused, go


def _down_without_journal(tmp_path) -> tuple[TieredStore, FlakyDisk]:
    """A store cpu -> lower with no journal, the lower tier down: refused blocks are remembered by hash."""
    lower = FlakyDisk(tmp_path / "lower", 4096 * OBJ, fsync=False)
    lower.down = True
    store = TieredStore([CpuTier(64 * OBJ, OBJ), lower], [make_policy("lru", 64), make_policy("lru", 4096)],
                        ["through", "through"])
    return store, lower


def _retry_meets_a_delete(store, lower: FlakyDisk, hs: list, obj, name: str) -> None:
    """The lower tier comes back; the retry tick pauses as obj.name returns, and hs[:2] are deleted then:
    the retry writes the others, not the deleted ones."""
    paused, go = _pause_after(obj, name)
    lower.down = False
    assert paused.wait(20)
    store.delete(hs[:2])
    go.set()
    assert until(lambda: lower.contains_many(hs[2:]) == [True, True])
    assert store.flush(10) and lower.contains_many(hs[:2]) == [False, False]
    assert store.lookup(hs) == 0


def test_a_retry_read_from_the_journal_before_a_delete_does_not_write_the_block_after_it(tmp_path):
    store, lower = open_pair(tmp_path, down=True)
    hs = hashes(4)
    # The lower tier is down: the blocks wait in its journal.
    store.store(NS, hs, [payload_for(h) for h in hs])
    assert store.flush(10) and len(store._state.journals[1]) == 4
    # It comes back; the retry tick reads the journal, and a delete comes before its write.
    _retry_meets_a_delete(store, lower, hs, store._state.journals[1], "read")
    store.close()


def test_a_retry_read_from_the_tiers_above_before_a_delete_does_not_write_the_block_after_it(tmp_path):
    # No journal: refused blocks are remembered by hash, their bytes read back from the memory tier.
    store, lower = _down_without_journal(tmp_path)
    hs = hashes(4)
    store.store(NS, hs, [payload_for(h) for h in hs])
    assert store.flush(10) and len(store._state.deferred[1]) == 4
    # The tier comes back; the tick reads the blocks from above, and a delete comes before its write.
    _retry_meets_a_delete(store, lower, hs, store._placement.backlog, "_read_above")
    store.close()


def test_a_delete_forgets_blocks_remembered_for_a_tier_that_was_down(tmp_path):
    store, _ = _down_without_journal(tmp_path)
    hs = hashes(4)
    store.store(NS, hs, [payload_for(h) for h in hs])
    assert store.flush(10)
    # Deleted while the tier is down: nothing of them is retried (not even a read above).
    store.delete(hs[:2])
    assert list(store._state.deferred[1]) == hs[2:]
    store.close()


def test_a_write_back_victim_picked_before_a_delete_does_not_land_after_it(tmp_path):
    store, lower = open_pair(tmp_path, cpu_blocks=4, mode="back")
    hs = hashes(5)
    store.store(NS, hs[:4], [payload_for(h) for h in hs[:4]])
    # A fifth block evicts the oldest; the victim has left the tier above, on its way down, when a delete comes.
    paused, go = _pause_after(store._placement, "evicted", before=True)
    done = threading.Thread(target=store.store, args=(NS, hs[4:], [payload_for(hs[4])]))
    done.start()
    assert paused.wait(20)
    store.delete(hs[:1])
    go.set()
    done.join(20)
    # It never reaches the tier below, nor its journal.
    assert store.flush(10)
    assert lower.contains_many(hs[:1]) == [False] and store.lookup(hs[:1]) == 0
    assert hs[0] not in store._state.journals[1]
    store.close()


def test_a_hit_read_before_a_delete_is_not_promoted_after_it(tmp_path):
    store = make_store(tmp_path, cpu_blocks=4, promote_after_hits=1)
    hs = hashes(8)
    # Eight blocks on disk; the memory tier keeps the last four.
    write_flushed(store, hs[:4])
    write_flushed(store, hs[4:])
    assert store.tiers[0].contains_many(hs[:1]) == [False]
    # A load reads the first from disk; a delete comes before its promotion is queued.
    paused, go = _pause_after(store._placement, "promote", before=True)
    loading = threading.Thread(target=store.load, args=(NS, hs[:1]))
    loading.start()
    assert paused.wait(20)
    store.delete(hs[:1])
    go.set()
    loading.join(20)
    # The promotion does not bring it back into memory.
    assert store.flush(10)
    assert store.tiers[0].contains_many(hs[:1]) == [False] and store.lookup(hs[:1]) == 0
    store.close()


def test_the_delete_log_answers_for_deletes_under_way_ended_and_forgotten():
    log, a, b, c = DeleteLog(most=2), b"a" * 16, b"b" * 16, b"c" * 16
    before = log.mark()
    # A delete under way: its block counts as deleted for any mark.
    with log.deleting([a]):
        assert log.deleted(log.mark(), [a, b]) == {a}
    # Ended: deleted for marks taken before its end, not for later ones.
    after_a = log.mark()
    assert log.deleted(before, [a, b]) == {a} and log.deleted(after_a, [a]) == set()
    # Past the bound the oldest is forgotten: a mark from before it answers "deleted" for every block.
    for h in (b, c):
        with log.deleting([h]):
            pass
    assert log.deleted(before, [a, b, c]) == {a, b, c}
    assert log.deleted(after_a, [a, b, c]) == {b, c}


def test_a_write_back_victim_on_its_way_down_is_still_found(tmp_path):
    store, lower = open_pair(tmp_path, cpu_blocks=4, mode="back")
    hs = hashes(5)
    store.store(NS, hs[:4], [payload_for(h) for h in hs[:4]])
    # A fifth block evicts the oldest; it has left the tier above and is not yet queued for the one below.
    paused, go = _pause_after(store._placement, "evicted", before=True)
    storing = threading.Thread(target=store.store, args=(NS, hs[4:], [payload_for(hs[4])]))
    storing.start()
    assert paused.wait(20)
    # Meanwhile it is still found, and loads.
    assert store.tiers[0].contains_many(hs[:1]) == [False] and lower.contains_many(hs[:1]) == [False]
    assert store.lookup(hs[:1]) == 1 and same(store.load(NS, hs[:1])[0], payload_for(hs[0]))
    go.set()
    storing.join(20)
    # It lands below, and the in-flight map is empty once it has.
    assert store.flush(10) and lower.contains_many(hs[:1]) == [True] and not store._state.inflight
    store.close()
