"""Writes a tier refuses while it is down are made once it is back, from the
bytes the tiers above still hold (the S3 outage case; the reliability suite
stops a real S3 gateway for the same story)."""
from __future__ import annotations

import threading
import time

from cache_service.store.eviction import make_policy
from cache_service.blocks.objects import decode
from cache_service.store.tiered_store import TieredStore
from tests.cache_service.store.store_helpers import NS, OBJ, FlakyDisk, all_same, hashes, payload_for, until
from tiers.cpu import CpuTier
from tiers.disk import DiskTier


def _store(tmp_path, cpu_blocks: int = 64) -> tuple[TieredStore, FlakyDisk]:
    lower = FlakyDisk(tmp_path / "lower", 1024 * OBJ, fsync=False)
    tiers = [CpuTier(cpu_blocks * OBJ, OBJ), lower]
    store = TieredStore(tiers, [make_policy("lru", cpu_blocks), make_policy("lru", 1024)], ["through", "through"])
    return store, lower


def _store_while_down(store: TieredStore, lower: FlakyDisk, hs) -> None:
    lower.down = True
    store.store(NS, hs, [payload_for(h) for h in hs])
    assert store.flush(10)


def test_blocks_refused_while_down_are_written_once_back(tmp_path):
    store, lower = _store(tmp_path)
    hs = hashes(10)
    # the lower tier is down: stores succeed (the top tier has them), the lower writes are deferred
    _store_while_down(store, lower, hs)
    assert lower.contains_many(hs) == [False] * 10
    assert store.stats()["disk"]["deferred"] == 10 and store.stats()["disk"]["dropped"] == 0
    # it comes back: within a writer tick or two, every block is there, byte-exact
    lower.down = False
    assert until(lambda: lower.contains_many(hs) == [True] * 10)
    assert all_same([decode(o, NS, h) for o, h in zip(lower.get_many(hs), hs)], hs)
    store.close()


def test_a_block_gone_from_the_tiers_above_is_counted_lost(tmp_path):
    store, lower = _store(tmp_path, cpu_blocks=64)
    hs = hashes(6)
    _store_while_down(store, lower, hs)
    # two blocks leave the top tier while the lower one is down: nothing is left to write them from
    store.tiers[0].delete_many(hs[:2])
    lower.down = False
    assert until(lambda: lower.contains_many(hs[2:]) == [True] * 4)
    assert until(lambda: store.stats()["disk"]["lost"] == 2)
    assert lower.contains_many(hs[:2]) == [False, False]
    store.close()


def test_a_deferred_write_refused_again_is_kept_for_a_later_tick(tmp_path):
    store, lower = _store(tmp_path)
    hs = hashes(5)
    _store_while_down(store, lower, hs)
    # back, but its first two write attempts still fail without it looking down
    lower.refuse, lower.down = 2, False
    # the refused retries are kept: a later tick writes every block, and none is counted dropped
    assert until(lambda: lower.contains_many(hs) == [True] * 5)
    assert lower.refuse == 0 and store.stats()["disk"]["dropped"] == store.stats()["disk"]["lost"] == 0
    store.close()


def test_live_writes_take_turns_with_an_outage_backlog(tmp_path):
    store, lower = _store(tmp_path, cpu_blocks=1024)
    backlog = hashes(640)
    # ten batches of writes refused while the lower tier was down
    _store_while_down(store, lower, backlog)
    # it comes back slow; the writer starts on the backlog
    lower.writing, lower.delay = threading.Event(), 0.05
    lower.down = False
    assert lower.writing.wait(20)
    # a live store arrives meanwhile: it lands after a batch or two of the backlog, not after all of it
    fresh = hashes(2, start=10_000)
    store.store(NS, fresh, [payload_for(h) for h in fresh])
    assert until(lambda: lower.contains_many(fresh) == [True, True])
    assert sum(lower.contains_many(backlog)) <= 320
    # and the backlog is all written in the end
    assert until(lambda: lower.contains_many(backlog) == [True] * 640)
    store.close()


class LateDisk(DiskTier):
    """A disk tier whose writes wait at a gate, and whose first read of a missing
    block opens the gate and lets the write land before answering "miss" (the
    write completing between the tier's read and the in-flight map's)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.gate, self.landed = threading.Event(), threading.Event()

    def put_many(self, hashes, objs):
        self.gate.wait(20)
        try:
            return super().put_many(hashes, objs)
        finally:
            self.landed.set()

    def get_many(self, hashes):
        got = super().get_many(hashes)
        if None in got and not self.gate.is_set():
            self.gate.set()
            self.landed.wait(20)
            time.sleep(0.2)  # the writer leaves the in-flight map right after the put
        return got


def test_a_write_that_lands_during_a_load_is_found(tmp_path):
    lower = LateDisk(tmp_path / "lower", 1024 * OBJ, fsync=False)
    store = TieredStore([CpuTier(OBJ, OBJ), lower], [make_policy("lru", 1), make_policy("lru", 1024)],
                        ["through", "through"])
    a, b = hashes(2)
    # A is stored, its write-through waits at the gate; B pushes A out of the one-block top tier
    store.store(NS, [a], [payload_for(a)])
    store.store(NS, [b], [payload_for(b)])
    assert store.tiers[0].contains_many([a]) == [False]
    # a load of A: whether it finds A still in flight or on the disk it just landed on, it finds it
    assert all_same(store.load(NS, [a]), [a])
    lower.gate.set()
    store.close()


def test_disk_blocks_recovered_after_an_unclean_stop_are_evicted_like_any_other(tmp_path):
    import subprocess
    import sys

    from cache_service.config import load_config
    from cache_service.factory import open_store
    # A process writes 20 blocks to a disk tier and ends without closing it.
    child = ("import os\nfrom tiers.disk import DiskTier\nfrom cache_service.blocks.encoding import encode_many\n"
             "from cache_service.blocks.objects import intact\n"
             "from tests.cache_service.store.store_helpers import NS, OBJ, hashes, payload_for\n"
             f"t = DiskTier({str(tmp_path)!r}, 40 * OBJ, fsync=True, check=intact)\n"
             "hs = hashes(20)\nassert all(t.put_many(hs, encode_many(NS, hs, [payload_for(h) for h in hs])))\n"
             "os._exit(0)\n")
    subprocess.run([sys.executable, "-c", child], check=True)
    # A store opens it with a policy of its own (LRU); the disk's sweep recovers the 20 blocks after that.
    tiers = {"cpu": {"capacity": 16 * OBJ, "slot_bytes": OBJ, "shared": "no"},
             "disk": {"path": str(tmp_path), "capacity": 40 * OBJ, "fsync": False, "policy": "lru"}}
    store = open_store(load_config(env={}, overrides={"tiers": tiers}))
    disk = store.tiers[1]
    assert disk.swept.wait(60) and disk.stats.blocks == 20
    # Sixty new blocks later the disk holds the newest forty: the recovered ones were evicted, not kept for good.
    new = hashes(60, start=1000)
    for a in range(0, 60, 5):
        store.store(NS, new[a:a + 5], [payload_for(h) for h in new[a:a + 5]])
        assert store.flush(30)
    assert sum(disk.contains_many(hashes(20))) == 0 and sum(disk.contains_many(new)) == 40
    store.close()
