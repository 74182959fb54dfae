"""The upload journal: blocks a lower tier refused while down, and write-back
victims on their way to it, are kept on local disk with their bytes until it
has them, across a restart of the store; the journal's bound holds and what
it refuses is counted. (The lower tier here is a real disk tier that can be
taken down, standing in for S3's availability; tests/reliability/test_journal.py
runs the same story against a real S3 gateway and a SIGKILLed daemon.)"""
from __future__ import annotations

import threading

import lmdb
import torch

from cache_service.blocks.objects import decode
from cache_service.config import StoreConfig
from cache_service.store.eviction import make_policy
from cache_service.store.journal import UploadJournal
from cache_service.store.tiered_store import TieredStore
from tests.cache_service.store.store_helpers import NS, OBJ, FlakyDisk, all_same, hashes, payload_for, until
from tiers.cpu import CpuTier

MB = 1 << 20


def open_pair(tmp_path, cpu_blocks: int = 64, mode: str = "through", journal_bytes: int = 8 * MB,
              down: bool = False, cfg: StoreConfig | None = None) -> tuple[TieredStore, FlakyDisk]:
    """A store cpu -> lower (journaled), the lower tier up or down from the start."""
    lower = FlakyDisk(tmp_path / "lower", 4096 * OBJ, fsync=False)
    lower.down = down
    journal = UploadJournal(tmp_path / "journal", journal_bytes, fsync=False)
    store = TieredStore([CpuTier(cpu_blocks * OBJ, OBJ), lower],
                        [make_policy("lru", cpu_blocks), make_policy("lru", 4096)], ["through", mode],
                        cfg, journals={"disk": journal})
    return store, lower


def in_lower(lower: FlakyDisk, hs) -> bool:
    got = lower.get_many(hs)
    return all(g is not None for g in got) and all_same([decode(o, NS, h) for o, h in zip(got, hs)], hs)


def test_refused_writes_are_journaled_and_written_after_a_restart(tmp_path):
    store, lower = open_pair(tmp_path, down=True)
    hs = hashes(50)
    # The lower tier is down: stores succeed; once flushed, every refused block is in the journal.
    store.store(NS, hs, [payload_for(h) for h in hs])
    assert store.flush(10)
    assert store.stats()["disk"]["journal_blocks"] == 50
    # The store goes away while the tier is down (its memory tier with it).
    store.close()
    # A new store on the same journal, the tier back: the journal alone brings every block down.
    store, lower = open_pair(tmp_path)
    assert until(lambda: store.stats()["disk"]["journal_blocks"] == 0)
    assert in_lower(lower, hs)
    assert store.stats()["disk"]["lost"] == 0
    store.close()


def test_write_back_victims_are_journaled_before_they_leave_the_tier_above(tmp_path):
    store, lower = open_pair(tmp_path, cpu_blocks=8, mode="back", down=True)
    hs = hashes(40)
    # Eight blocks fit above; the 32 evicted while the lower tier is down exist only in the journal now.
    for k in range(0, 40, 4):
        store.store(NS, hs[k:k + 4], [payload_for(h) for h in hs[k:k + 4]])
    assert store.flush(10)
    assert store.stats()["disk"]["journal_blocks"] == 32
    store.close()
    # After a restart with the tier back, every victim reaches it.
    store, lower = open_pair(tmp_path, cpu_blocks=8, mode="back")
    assert until(lambda: store.stats()["disk"]["journal_blocks"] == 0)
    assert in_lower(lower, hs[:32])
    store.close()


def test_with_the_tier_up_the_journal_empties_as_blocks_land(tmp_path):
    store, lower = open_pair(tmp_path, cpu_blocks=8, mode="back")
    hs = hashes(40)
    for k in range(0, 40, 4):
        store.store(NS, hs[k:k + 4], [payload_for(h) for h in hs[k:k + 4]])
    # Victims pass through the journal on their way down and leave it once they land.
    assert store.flush(10)
    assert until(lambda: in_lower(lower, hs[:32]))
    assert store.stats()["disk"]["journal_blocks"] == 0 and store.stats()["disk"]["lost"] == 0
    store.close()


def test_a_deleted_block_is_not_written_from_the_journal(tmp_path):
    store, lower = open_pair(tmp_path, down=True)
    hs = hashes(6)
    store.store(NS, hs, [payload_for(h) for h in hs])
    assert store.flush(10)
    # Deleted while the tier is down: the journal forgets it too.
    store.delete(hs[:2])
    lower.down = False
    assert until(lambda: store.stats()["disk"]["journal_blocks"] == 0)
    assert lower.contains_many(hs) == [False, False] + [True] * 4
    store.close()


def test_the_bound_holds_and_what_it_refuses_is_counted(tmp_path):
    store, lower = open_pair(tmp_path, cpu_blocks=4096, journal_bytes=MB, down=True)
    journal = store._state.journals[1]
    hs = hashes(2000)
    # Far more refused blocks than a 1 MiB journal holds.
    for k in range(0, 2000, 100):
        store.store(NS, hs[k:k + 100], [payload_for(h) for h in hs[k:k + 100]])
        assert store.flush(10)
        assert journal.file_bytes() <= journal.file_limit <= MB + MB // 4
    s = store.stats()["disk"]
    # The file never outgrew its bound; every block is journaled or counted refused.
    assert 0 < s["journal_blocks"] < 2000 and s["journal_blocks"] + s["journal_refused"] == 2000
    # The refused ones were kept in memory (their bytes still above): all land once the tier is back.
    lower.down = False
    assert until(lambda: lower.contains_many(hs) == [True] * 2000, 60)
    assert store.stats()["disk"]["lost"] == 0
    store.close()


def test_a_damaged_journal_is_set_aside_and_started_empty(tmp_path):
    path = tmp_path / "journal"
    path.mkdir()
    (path / "data.mdb").write_bytes(b"\x17" * 65536)
    journal = UploadJournal(path, MB, fsync=False)
    assert len(journal) == 0 and list(tmp_path.glob("journal.damaged-*"))
    journal.close()


class _FailingOnce:
    """The journal's lmdb environment, failing the next transaction of a kind (`write` or not) once."""

    def __init__(self, env, write: bool) -> None:
        self.env, self.write, self.failed = env, write, False

    def __getattr__(self, name):
        return getattr(self.env, name)

    def begin(self, write: bool = False, **kw):
        if write == self.write and not self.failed:
            self.failed = True
            raise lmdb.ReadersFullError("a transient failure")
        return self.env.begin(write=write, **kw)


def test_a_failing_journal_read_keeps_its_entries_for_the_next_tick(tmp_path):
    store, lower = open_pair(tmp_path, down=True)
    journal, hs = store._state.journals[1], hashes(6)
    # Refused while the tier is down: journaled.
    store.store(NS, hs, [payload_for(h) for h in hs])
    assert store.flush(10) and len(journal) == 6
    # The tier comes back, and the journal's first read fails (a full reader table, an I/O error that passes).
    journal._env = _FailingOnce(journal._env, write=False)
    lower.down = False
    # Nothing is forgotten or counted lost for it: the next tick reads them and they land.
    assert until(lambda: in_lower(lower, hs)) and journal._env.failed
    assert store.stats()["disk"]["lost"] == 0 and len(journal) == 0
    store.close()


def test_writes_a_close_gives_up_on_are_kept_in_the_journal(tmp_path):
    store, lower = open_pair(tmp_path, cfg=StoreConfig(flush_timeout_s=1.0, queue_depth=64))
    # The lower tier hangs (an S3 that accepts connections and never answers) while it says it is up.
    hung, real = threading.Event(), lower.put_many
    lower.put_many = lambda hs, objs: (hung.wait(30), real(hs, objs))[1]
    hs = hashes(60)
    store.store(NS, hs, [payload_for(h) for h in hs])
    # The store closes: its flush times out with the writes queued or under way, and they go into the journal.
    store.close()
    hung.set()
    # A new store with the tier answering again writes every acknowledged block from the journal.
    store, lower = open_pair(tmp_path)
    assert until(lambda: store.stats()["disk"]["journal_blocks"] == 0)
    assert in_lower(lower, hs)
    store.close()


def test_a_tier_that_hangs_never_stalls_a_store_its_journal_takes_the_overflow(tmp_path, monkeypatch):
    import time

    import cache_service.store.placement as placement

    monkeypatch.setattr(placement, "STUCK_S", 0.5)
    store, lower = open_pair(tmp_path, cfg=StoreConfig(queue_depth=8))
    hung, real = threading.Event(), lower.put_many
    lower.put_many = lambda hs, objs: (hung.wait(30), real(hs, objs))[1]
    # The lower tier hangs; stores go on, more than its queue holds: once its writer is stuck, none waits.
    hs = hashes(64)
    t = time.monotonic()
    for k in range(0, 64, 4):
        store.store(NS, hs[k:k + 4], [payload_for(h) for h in hs[k:k + 4]])
    assert time.monotonic() - t < 5
    # What the queue could not take is in the journal; once the tier answers, every block lands.
    assert store.stats()["disk"]["journal_blocks"] > 0
    hung.set()
    assert until(lambda: store.stats()["disk"]["journal_blocks"] == 0) and store.flush(20)
    assert in_lower(lower, hs)
    store.close()


def test_a_slow_tier_with_a_journal_is_waited_for_and_loses_nothing(tmp_path):
    # A lower tier that is up but slow (20 ms a batch), a short queue and a journal far too small for the stores.
    store, lower = open_pair(tmp_path, journal_bytes=1 << 20, cfg=StoreConfig(queue_depth=8))
    lower.delay, lower.writing = 0.02, threading.Event()
    hs = hashes(600)  # more than the journal holds (a 1 MiB map)
    for k in range(0, 600, 20):
        store.store(NS, hs[k:k + 20], [payload_for(h) for h in hs[k:k + 20]])
    # The stores waited for room, as queue_full = "wait" says: every block reaches the tier, none is lost.
    assert store.flush(60) and in_lower(lower, hs)
    assert store.stats()["disk"]["lost"] == 0 and store.stats()["disk"]["journal_blocks"] == 0
    store.close()
