"""The store's copy-saving paths: load_into, store_objects, the CPU pool's
background pre-fault, and eviction counting at the bottom of the hierarchy."""
from __future__ import annotations

import threading

import pytest
import torch

from cache_service.blocks.objects import HEADER_SIZE, decode, encode, encode_into
from tests.cache_service.store.store_helpers import NS, OBJ, hashes, make_store, payload_for, same
from tiers.cpu import CpuTier
from tiers.types import CorruptBlockError


def _buffers(n: int) -> list[torch.Tensor]:
    """Object-sized views of one arena, like a client's shared-memory slots."""
    arena = torch.full((n * OBJ,), 0xAB, dtype=torch.uint8)
    return [arena[i * OBJ: (i + 1) * OBJ] for i in range(n)]


def test_load_into_copies_hits_into_the_callers_buffers(tmp_path):
    store = make_store(tmp_path, cpu_blocks=16, disk_blocks=None)
    hs = hashes(6)
    store.store(NS, hs[:4], [payload_for(h) for h in hs[:4]])
    # four hits, two misses: hits are whole verified objects in place
    outs = _buffers(6)
    assert store.load_into(NS, hs, outs) == [True] * 4 + [False] * 2
    for out, h in zip(outs[:4], hs[:4]):
        assert same(decode(out, NS, h), payload_for(h))
    assert store.stats()["cpu"]["hits"] == 4 and store.stats()["cpu"]["misses"] == 2
    # the same into one [n, object_size] tensor (headers checked in one pass)
    rows = torch.stack(_buffers(6))
    assert store.load_into(NS, hs, rows) == [True] * 4 + [False] * 2
    assert all(same(decode(row, NS, h), payload_for(h)) for row, h in zip(rows[:4], hs[:4]))
    store.close()


def test_load_into_reads_lower_tiers_and_promotes(tmp_path):
    # blocks pushed down to disk by pressure on a 4-block CPU tier
    store = make_store(tmp_path, cpu_blocks=4)
    hs = hashes(12)
    store.store(NS, hs, [payload_for(h) for h in hs])
    store.flush()
    assert store.stats()["disk"]["blocks"] == 12
    # two blocks only on disk come into the buffers, and on their second hit back into the CPU tier
    below = [h for h, ok in zip(hs, store.tiers[0].contains_many(hs)) if not ok][:2]
    for _ in range(2):
        outs = _buffers(2)
        assert store.load_into(NS, below, outs) == [True, True]
        assert all(same(decode(o, NS, h), payload_for(h)) for o, h in zip(outs, below))
    store.flush()  # promotions land in the background
    assert store.stats()["cpu"]["promoted"] == 2
    assert store.tiers[0].contains_many(below) == [True, True]
    store.close()


def test_load_into_quarantines_a_corrupt_slot_and_falls_back(tmp_path):
    store = make_store(tmp_path, cpu_blocks=8)
    hs = hashes(1)
    store.store(NS, hs, [payload_for(hs[0])])
    store.flush()
    # a bit flips in the CPU copy's header
    pool = store.tiers[0]
    slot = pool._index[hs[0]][0]
    pool._pool[slot, 30] ^= 0xFF
    # the load still succeeds from disk; the CPU copy is counted corrupt and replaced
    outs = _buffers(1)
    assert store.load_into(NS, hs, outs) == [True]
    assert same(decode(outs[0], NS, hs[0]), payload_for(hs[0]))
    assert store.stats()["cpu"]["corrupt"] == 1
    store.close()


def test_store_objects_takes_encoded_objects_and_rejects_bad_ones(tmp_path):
    store = make_store(tmp_path, cpu_blocks=8)
    hs = hashes(3)
    outs = _buffers(3)
    for out, h in zip(outs, hs):
        encode_into(out, NS, h, payload_for(h))
    # one payload byte changed after encoding: nothing of the batch is stored
    outs[2][HEADER_SIZE + 7] ^= 1
    with pytest.raises(CorruptBlockError):
        store.store_objects(NS, hs, outs)
    assert store.lookup(hs) == 0
    # fixed, the batch goes in; reusing the caller's buffers afterwards changes nothing stored
    outs[2][HEADER_SIZE + 7] ^= 1
    assert store.store_objects(NS, hs, outs) == 3
    for out in outs:
        out.zero_()
    store.flush()
    assert all(same(p, payload_for(h)) for p, h in zip(store.load(NS, hs), hs))
    # the disk tier (written in the background) got its own copies too
    store.delete([h for h in hs])
    assert store.lookup(hs) == 0
    store.close()


def test_store_objects_background_copies_survive_buffer_reuse(tmp_path):
    # write-through disk: the writer sees the objects after store_objects returned
    store = make_store(tmp_path, cpu_blocks=2, disk_blocks=64)
    hs = hashes(6)
    outs = _buffers(6)
    for out, h in zip(outs, hs):
        encode_into(out, NS, h, payload_for(h))
    store.store_objects(NS, hs, outs)
    for out in outs:
        out.zero_()
    store.flush()
    # every block reads back intact, most of them from disk
    assert all(p is not None and same(p, payload_for(h)) for p, h in zip(store.load(NS, hs), hs))
    assert store.stats()["disk"]["corrupt"] == 0
    store.close()


def test_evictions_from_the_bottom_tier_are_counted(tmp_path):
    # a CPU-only store of 4 blocks takes 10: 6 are evicted with nowhere to go
    store = make_store(tmp_path, cpu_blocks=4, disk_blocks=None)
    hs = hashes(10)
    for h in hs:
        store.store(NS, [h], [payload_for(h)])
    st = store.stats()["cpu"]
    assert st["evictions"] == 6 and st["demoted"] == 0 and st["blocks"] == 4
    store.close()


def test_evictions_count_once_per_block_when_demoted(tmp_path):
    store = make_store(tmp_path, cpu_blocks=4)
    hs = hashes(10)
    for h in hs:
        store.store(NS, [h], [payload_for(h)])
    store.flush()
    st = store.stats()["cpu"]
    assert st["evictions"] == 6 and st["demoted"] + st["dropped"] <= 6
    store.close()


def test_prefault_never_overwrites_live_slots():
    # a pool starts touching its pages in the background; puts race it
    size = 64 << 10
    pool = CpuTier(capacity_bytes=256 * size, slot_bytes=size, pin=False, prefault=True)
    objs = {}
    errors = []

    def putter(start: int) -> None:
        try:
            for i in range(start, start + 100):
                h = i.to_bytes(16, "little")
                objs[h] = torch.full((size,), i % 251 + 1, dtype=torch.uint8)
                assert pool.put_many([h], [objs[h]]) == [True]
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=putter, args=(k * 100,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    # wait for the toucher to finish, then every stored object is still intact
    for t in threading.enumerate():
        if t.name == "cpu-prefault":
            t.join(30)
    got = pool.get_many(list(objs))
    assert all(torch.equal(g, objs[h]) for g, h in zip(got, objs))
    assert pool.free_bytes() == (256 - 200) * size
    pool.close()


def test_store_objects_leaves_the_same_objects_as_store(tmp_path):
    # store() and store_objects() leave identical objects in the pool
    a, b = make_store(tmp_path / "a", disk_blocks=None), make_store(tmp_path / "b", disk_blocks=None)
    hs = hashes(2)
    a.store(NS, hs, [payload_for(h) for h in hs])
    b.store_objects(NS, hs, [encode(NS, h, payload_for(h)) for h in hs], owned=True)
    assert all(torch.equal(x, y) for x, y in zip(a.tiers[0].get_many(hs), b.tiers[0].get_many(hs)))
    a.close()
    b.close()
