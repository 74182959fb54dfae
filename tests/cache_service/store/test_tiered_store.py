"""TieredStore over a real CPU pool and a real disk tier (files + lmdb)."""
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cache_service.config import load_config
from cache_service.factory import open_store
from cache_service.blocks.objects import encode
from tests.cache_service.store.store_helpers import NS, OBJ, all_same, hashes, make_store, payload_for, same
from tests.tiers.disk_objects import read_at, write_at

ROOT = Path(__file__).resolve().parents[3]


def test_thousand_blocks_through_small_cpu_over_disk_all_load_back(tmp_path):
    # 1,000 blocks go through a 16-block CPU tier; the rest are demoted to disk
    store = make_store(tmp_path, cpu_blocks=16, disk_blocks=1200)
    hs = hashes(1000)
    peak = {"cpu": 0, "disk": 0}
    for i in range(0, 1000, 50):
        store.store(NS, hs[i:i + 50], [payload_for(h) for h in hs[i:i + 50]])
        for t in store.tiers:
            peak[t.name] = max(peak[t.name], t.stats.used_bytes)
            assert t.stats.used_bytes <= t.capacity_bytes
    store.flush()
    # every block is visible and loads back byte-identical
    assert store.lookup(hs) == 1000
    got = store.load(NS, hs)
    assert all(g is not None and same(g, payload_for(h)) for g, h in zip(got, hs))
    st = store.stats()
    assert st["cpu"]["evictions"] + st["cpu"]["bypassed"] >= 1000 - 16 and st["disk"]["hits"] > 0
    assert peak["cpu"] <= 16 * OBJ and peak["disk"] <= 1200 * OBJ
    store.close()


def test_lookup_is_the_longest_stored_prefix(tmp_path):
    # store blocks 0-4 and 6; the prefix ends at the first hole
    store = make_store(tmp_path, disk_blocks=None)
    hs = hashes(8)
    store.store(NS, hs[:5] + hs[6:7], [payload_for(h) for h in hs[:5] + hs[6:7]])
    assert store.lookup(hs) == 5 and store.lookup(hs[:3]) == 3 and store.lookup(hs[5:]) == 0
    store.close()


def test_a_prefix_held_across_tiers_block_by_block_counts_whole(tmp_path):
    # blocks 0, 2, 4 only in the CPU tier, 1 and 3 only on disk, 5 nowhere, 6 in both
    store = make_store(tmp_path)
    cpu, disk = store.tiers
    hs = hashes(7)
    objs = [encode(NS, h, payload_for(h)) for h in hs]
    assert all(cpu.put_many([hs[i] for i in (0, 2, 4, 6)], [objs[i] for i in (0, 2, 4, 6)]))
    assert all(disk.put_many([hs[i] for i in (1, 3, 6)], [objs[i] for i in (1, 3, 6)]))
    # the tiers between them hold 0-4: the prefix runs to the hole at 5, from any start before it
    assert store.lookup(hs) == 5 and store.lookup(hs[1:]) == 4 and store.lookup(hs[3:5]) == 2
    # past the hole, one tier alone or both
    assert store.lookup(hs[5:]) == 0 and store.lookup(hs[6:]) == 1 and store.lookup([]) == 0
    store.close()


def test_disk_blocks_survive_a_new_process(tmp_path):
    # a child process stores blocks and exits; this process reopens the disk tier
    code = ("import sys; from tests.cache_service.store.store_helpers import *;"
            "s = make_store(sys.argv[1], cpu_blocks=8, disk_blocks=512); hs = hashes(200);"
            "s.store(NS, hs, [payload_for(h) for h in hs]); s.close()")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, cwd=ROOT, timeout=120)
    store = make_store(tmp_path, cpu_blocks=8, disk_blocks=512)
    hs = hashes(200)
    assert store.lookup(hs) == 200
    got = store.load(NS, hs)
    assert all(same(g, payload_for(h)) for g, h in zip(got, hs))
    store.close()


def _corrupt(place, how: str, other) -> None:
    data = read_at(place)
    if how == "truncate":
        write_at(place, data[: len(data) // 2])
    elif how == "bitflip":
        write_at(place, data[:500] + bytes([data[500] ^ 4]) + data[501:])
    elif how == "swap":
        write_at(place, read_at(other))
    elif how == "delete":
        write_at(place, None)


@pytest.mark.parametrize("how", ["truncate", "bitflip", "swap", "delete"])
def test_damaged_disk_files_are_misses_never_returned(tmp_path, how):
    # blocks live only on disk (the CPU tier is dropped by reopening)
    hs = hashes(6)
    with make_store(tmp_path) as store:
        store.store(NS, hs, [payload_for(h) for h in hs])
    store = make_store(tmp_path)
    disk = store.tiers[1]
    _corrupt(disk.location_of(hs[2]), how, disk.location_of(hs[3]))
    # the damaged block is a miss; the prefix ends there; the others load exactly
    got = store.load(NS, hs)
    assert got[2] is None
    assert all(same(g, payload_for(h)) for i, (g, h) in enumerate(zip(got, hs)) if i != 2)
    assert store.lookup(hs) == 2
    if how != "delete":
        assert store.stats()["disk"]["corrupt"] >= 1
    store.close()


def test_foreign_object_with_valid_file_checksum_is_quarantined(tmp_path):
    # another tenant's object sits on disk under our key, with a valid file checksum
    hs = hashes(1)
    store = make_store(tmp_path)
    foreign = encode(NS.with_tenant("intruder"), hs[0], payload_for(hs[0]))
    assert store.tiers[1].put_many(hs, [foreign]) == [True]
    # the header check refuses it: a miss, counted, and taken out of service
    assert store.load(NS, hs) == [None]
    assert store.stats()["disk"]["corrupt"] == 1
    assert store.lookup(hs) == 0
    store.close()


def test_a_good_copy_stored_after_a_bad_read_is_not_quarantined(tmp_path):
    # another tenant's object sits on disk under our key
    hs = hashes(1)
    store = make_store(tmp_path)
    foreign = encode(NS.with_tenant("intruder"), hs[0], payload_for(hs[0]))
    assert store.tiers[1].put_many(hs, [foreign]) == [True]
    # a load reads it; before the store takes it out, the block is deleted and stored again, sound
    quarantine, disk = store._placement.quarantine, store.tiers[1]

    def after_a_re_put(i, hashes, *a):
        disk.delete_many(hs)
        disk.put_many(hs, [encode(NS, hs[0], payload_for(hs[0]))])
        return quarantine(i, hashes, *a)

    store._placement.quarantine = after_a_re_put
    assert store.load(NS, hs) == [None]
    # the quarantine leaves the good copy in service: the next load hits it
    store._placement.quarantine = quarantine
    assert disk.contains_many(hs) == [True] and same(store.load(NS, hs)[0], payload_for(hs[0]))
    store.close()


def test_pinned_blocks_survive_pressure_until_their_ttl(tmp_path):
    # a CPU-only store holds 8 blocks; 3 are pinned for 1.5 s
    store = make_store(tmp_path, cpu_blocks=8, disk_blocks=None)
    pinned = hashes(3, start=10_000)
    store.store(NS, pinned, [payload_for(h) for h in pinned])
    store.pins.pin(pinned, ttl_s=1.5)
    # heavy pressure: 100 other blocks stream through
    for i in range(0, 100, 10):
        hs = hashes(10, start=4 * i)
        store.store(NS, hs, [payload_for(h) for h in hs])
    assert store.lookup(pinned) == 3
    # after the TTL the pins lapse and pressure evicts them
    time.sleep(1.6)
    hs = hashes(20, start=50_000)
    store.store(NS, hs, [payload_for(h) for h in hs])
    assert store.lookup(pinned[:1]) == 0
    store.close()


def test_a_tier_full_of_pinned_blocks_sends_new_blocks_below(tmp_path):
    # every CPU slot pinned: new blocks bypass the CPU tier and land on disk
    store = make_store(tmp_path, cpu_blocks=4)
    first = hashes(4, start=9000)
    store.store(NS, first, [payload_for(h) for h in first])
    store.pins.pin(first)
    hs = hashes(10)
    store.store(NS, hs, [payload_for(h) for h in hs])
    store.flush()
    assert store.lookup(hs) == 10 and store.stats()["cpu"]["bypassed"] >= 10
    assert all(same(g, payload_for(h)) for g, h in zip(store.load(NS, hs), hs))
    store.close()


def test_disk_hits_are_promoted_to_cpu_on_their_second_hit(tmp_path):
    # blocks on disk only
    hs = hashes(5)
    with make_store(tmp_path) as store:
        store.store(NS, hs, [payload_for(h) for h in hs])
    store = make_store(tmp_path)
    # a first read comes from disk and copies nothing up (a one-shot read)
    assert all_same(store.load(NS, hs), hs)
    store.flush()
    assert store.stats()["disk"]["hits"] == 5 and store.stats()["cpu"]["promoted"] == 0
    # the second read promotes them, in the background: once flushed, the CPU tier has them
    assert all_same(store.load(NS, hs), hs)
    store.flush()
    assert store.stats()["disk"]["hits"] == 10 and store.stats()["cpu"]["promoted"] == 5
    store.load(NS, hs)
    assert store.stats()["cpu"]["hits"] == 5
    store.close()


def test_promote_after_hits_one_promotes_every_hit_and_zero_none(tmp_path):
    # every hit promotes with 1, none with 0
    hs = hashes(3)
    with make_store(tmp_path) as store:
        store.store(NS, hs, [payload_for(h) for h in hs])
    for after, promoted in ((1, 3), (0, 0)):
        store = make_store(tmp_path, cpu_blocks=16, promote_after_hits=after)
        for _ in range(3):
            assert all_same(store.load(NS, hs), hs)
            store.flush()  # a load before the promotion lands reads the disk again and promotes again
        assert store.stats()["cpu"]["promoted"] == promoted, after
        store.close()


class _SlowDisk:
    """Wraps a real disk tier's put_many with a gate so the writer queue fills."""

    def __init__(self, tier):
        self.gate = threading.Event()
        self._put = tier.put_many
        tier.put_many = self.put_many

    def put_many(self, hs, objs):
        self.gate.wait(30)
        return self._put(hs, objs)


def test_queue_full_skip_drops_lower_copies_without_waiting(tmp_path):
    # queue depth 2 and a stalled disk writer: store() never waits, drops are counted
    store = make_store(tmp_path, cpu_blocks=64, queue_depth=2, queue_full="skip")
    slow = _SlowDisk(store.tiers[1])
    hs = hashes(20)
    store.store(NS, hs, [payload_for(h) for h in hs])
    assert store.stats()["disk"]["dropped"] >= 20 - 2 - 64  # at least the overflow
    assert store.stats()["disk"]["dropped"] > 0 and store.lookup(hs) == 20
    slow.gate.set()
    store.close()


def test_queue_full_wait_blocks_until_the_writer_catches_up(tmp_path):
    # queue depth 2 and a stalled disk writer: store() waits, nothing is dropped
    store = make_store(tmp_path, cpu_blocks=64, queue_depth=2, queue_full="wait")
    slow = _SlowDisk(store.tiers[1])
    hs = hashes(20)
    t = threading.Thread(target=lambda: store.store(NS, hs, [payload_for(h) for h in hs]))
    t.start()
    t.join(0.5)
    assert t.is_alive(), "store() should wait for queue space"
    slow.gate.set()
    t.join(30)
    store.flush()
    assert store.stats()["disk"]["dropped"] == 0
    assert store.tiers[1].contains_many(hs) == [True] * 20
    store.close()


def test_delete_removes_every_copy(tmp_path):
    hs = hashes(4)
    store = make_store(tmp_path)
    store.store(NS, hs, [payload_for(h) for h in hs])
    store.flush()
    store.delete(hs[:2])
    assert store.lookup(hs) == 0 and store.lookup(hs[2:]) == 2
    store.close()


def test_store_rejects_mismatched_arguments(tmp_path):
    store = make_store(tmp_path, disk_blocks=None)
    with pytest.raises(ValueError, match="payloads"):
        store.store(NS, hashes(2), [payload_for(hashes(1)[0])])
    with pytest.raises(ValueError):
        store.store(NS, hashes(1), [payload_for(hashes(1)[0])[:1]])
    store.close()


def test_config_builds_the_documented_hierarchy(tmp_path):
    cfg = load_config(env={}, overrides={"tiers": {"disk": {"path": str(tmp_path), "capacity": "1MiB"}}})
    with open_store(cfg) as store:
        assert [t.name for t in store.tiers] == ["cpu", "disk"] and store.modes == ["back", "through"]
