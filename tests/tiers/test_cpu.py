"""The fixed-slot memory pools: CpuTier, and HbmTier on the "cpu" device
(both are `tiers.cpu.SlotPool`; device-specific checks are in test_hbm.py)."""
from __future__ import annotations

import random
import threading

import pytest
import torch

from cache_service.blocks.keys import Namespace
from cache_service.blocks.objects import decode, encode, object_size
import tiers.cpu
from tiers.base import SlotTier
from tiers.cpu import CpuTier
from tiers.hbm import HbmTier
from tiers.types import BlockHash, CapacityError, ConfigError, TierKVError

SLOT = 256
POOLS = {
    "cpu": lambda cap, slot=SLOT: CpuTier(cap, slot),
    "cpu-shared": lambda cap, slot=SLOT: CpuTier(cap, slot, shared=True),  # in a memfd (tests/tiers/test_shared_pool.py)
    "hbm-on-cpu": lambda cap, slot=SLOT: HbmTier(cap, slot, device="cpu"),
}


@pytest.fixture(params=sorted(POOLS))
def make_pool(request):
    return POOLS[request.param]


def key(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def content(i: int, n: int = SLOT) -> torch.Tensor:
    """Bytes of object i: seeded by i, so any reader can check them."""
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))


def test_pools_are_slot_tiers_with_their_capabilities(make_pool):
    # the store tells slot pools from other tiers by SlotTier, not by probing for methods
    pool = make_pool(4 * SLOT)
    assert isinstance(pool, SlotTier)
    assert pool.num_slots == 4 and pool.rows.shape == (4, SLOT) and pool.slot_bytes == SLOT
    assert pool.shared == (pool.share_fd >= 0)


def test_round_trip_is_byte_identical(make_pool):
    pool = make_pool(8 * SLOT)
    # A real block object and a short one share the pool (both fit a slot).
    ns = Namespace("m", "float16", num_layers=1, kv_heads=1, head_dim=4, block_tokens=8)
    assert object_size(ns) <= SLOT
    payload = torch.randn(ns.block_shape).half()
    block = encode(ns, key(1), payload)
    short = content(2, 100)
    assert pool.put_many([key(1), key(2)], [block, short]) == [True, True]
    # Reads give back exactly what was put, including the shorter object's length.
    got_block, got_short = pool.get_many([key(1), key(2)])
    assert torch.equal(got_block, block) and torch.equal(got_short, short)
    assert torch.equal(decode(got_block, ns, key(1), verify_payload=pool.verify_payload), payload)
    assert pool.contains_many([key(1), key(2), key(3)]) == [True, True, False]


def test_returned_tensors_survive_delete_and_slot_reuse(make_pool):
    pool = make_pool(2 * SLOT)
    pool.put_many([key(1), key(2)], [content(1), content(2)])
    first = pool.get_many([key(1)])[0]
    into = torch.empty(SLOT, dtype=torch.uint8)
    assert pool.get_into([key(2)], [into]) == [True]
    # Free both slots and overwrite them with other objects.
    assert pool.delete_many([key(1), key(2), key(9)]) == 2
    assert pool.put_many([key(3), key(4)], [content(3), content(4)]) == [True, True]
    # What was handed out earlier still holds the old bytes.
    assert torch.equal(first, content(1)) and torch.equal(into, content(2))
    assert pool.get_many([key(1), key(2)]) == [None, None]


def test_capacity_is_never_exceeded(make_pool):
    # 5.5 slots of capacity -> 5 slots.
    pool = make_pool(5 * SLOT + SLOT // 2)
    ok = pool.put_many([key(i) for i in range(8)], [content(i) for i in range(8)])
    assert ok == [True] * 5 + [False] * 3
    assert pool.free_bytes() == 0 and pool.stats.used_bytes == 5 * SLOT <= pool.capacity_bytes
    assert pool.get_many([key(5)]) == [None]
    # A put of a held block still succeeds when full; a delete makes room for a new one.
    assert pool.put_many([key(0)], [content(0)]) == [True]
    assert pool.delete_many([key(0)]) == 1
    assert pool.free_bytes() == SLOT
    assert pool.put_many([key(6), key(7)], [content(6), content(7)]) == [True, False]


def test_oversized_object_raises_and_stores_nothing(make_pool):
    pool = make_pool(4 * SLOT)
    with pytest.raises(CapacityError):
        pool.put_many([key(1), key(2)], [content(1), content(2, SLOT + 1)])
    assert pool.contains_many([key(1), key(2)]) == [False, False]
    with pytest.raises(CapacityError):
        pool.footprint(SLOT + 1)
    assert pool.footprint(10) == SLOT  # any object takes a whole slot


def test_get_into_fills_caller_buffers(make_pool):
    pool = make_pool(4 * SLOT)
    pool.put_many([key(1), key(2)], [content(1), content(2, 64)])
    # Buffers may be larger than the object; only the prefix is written.
    outs = [torch.full((SLOT,), 7, dtype=torch.uint8) for _ in range(3)]
    assert pool.get_into([key(1), key(3), key(2)], outs) == [True, False, True]
    assert torch.equal(outs[0], content(1))
    assert (outs[1] == 7).all(), "a miss leaves its buffer alone"
    assert torch.equal(outs[2][:64], content(2, 64)) and (outs[2][64:] == 7).all()
    # A buffer too small for the object is a caller error.
    with pytest.raises(TierKVError):
        pool.get_into([key(1)], [torch.empty(SLOT - 1, dtype=torch.uint8)])


def test_stats_follow_every_operation(make_pool):
    pool = make_pool(4 * SLOT)
    pool.put_many([key(1), key(2)], [content(1), content(2, 100)])
    # Already held, or twice in one batch: stored once, no new bytes.
    assert pool.put_many([key(1), key(2), key(2)], [content(1), content(2, 100), content(2, 100)]) == [True] * 3
    pool.get_many([key(1), key(3)])
    pool.get_into([key(2)], [torch.empty(SLOT, dtype=torch.uint8)])
    s = pool.stats
    assert (s.hits, s.misses, s.bytes_in, s.bytes_out) == (2, 1, SLOT + 100, SLOT + 100)
    assert (s.blocks, s.used_bytes) == (2, 2 * SLOT)
    pool.delete_many([key(1)])
    assert (pool.stats.blocks, pool.stats.used_bytes) == (1, SLOT)


def test_lazy_slot_sizing(make_pool, caplog):
    pool = make_pool(1000, None)
    assert pool.free_bytes() == 1000 and pool.slot_bytes == 0
    # The first object sizes the slots: 1000 // 300 = 3 slots.
    assert pool.put_many([key(1)], [content(1, 300)]) == [True]
    assert (pool.slot_bytes, pool.num_slots, pool.free_bytes()) == (300, 3, 600)
    # Larger objects (another model's blocks) never fit: refused, and said once in the log, naming the setting.
    for _ in range(3):
        with pytest.raises(CapacityError):
            pool.put_many([key(2)], [content(2, 301)])
    assert sum("slot_bytes" in r.getMessage() for r in caplog.records) == 1
    # An object larger than the whole tier can never be the first one either.
    with pytest.raises(CapacityError):
        make_pool(1000, None).put_many([key(1)], [content(1, 1001)])


def test_closed_pool_refuses_use(make_pool):
    pool = make_pool(2 * SLOT)
    pool.put_many([key(1)], [content(1)])
    pool.close()
    with pytest.raises(TierKVError):
        pool.get_many([key(1)])
    with pytest.raises(TierKVError):
        pool.put_many([key(2)], [content(2)])


def test_slot_deleted_during_a_read_is_not_reused_until_the_read_ends(make_pool, monkeypatch):
    pool = make_pool(2 * SLOT)
    pool.put_many([key(1)], [content(1)])
    real_copy, raced = tiers.cpu.copy_all, []

    def copy_after_race(pairs):
        # Another thread deletes the block being read and stores a new one first.
        if not raced:
            raced.append(pool.delete_many([key(1)]))
            raced.append(pool.put_many([key(2), key(3)], [content(2), content(3)]))
        real_copy(pairs)

    monkeypatch.setattr(tiers.cpu, "copy_all", copy_after_race)
    got = pool.get_many([key(1)])[0]
    # The read still gets block 1; the freed slot was held back, so only one new block fit.
    assert raced == [1, [True, False]]
    assert torch.equal(got, content(1))
    # Once the read is over the slot is free again.
    assert pool.free_bytes() == SLOT and pool.put_many([key(3)], [content(3)]) == [True]


def test_threads_putting_reading_and_deleting(make_pool):
    # Eight keys compete for four slots, so slots are freed and reused under readers.
    pool = make_pool(4 * SLOT)
    errors: list[str] = []

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(400):
            i = rng.randrange(8)
            pool.put_many([key(i)], [content(i)])
            pool.delete_many([key(rng.randrange(8))])

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        into = [torch.empty(SLOT, dtype=torch.uint8) for _ in range(2)]
        for _ in range(400):
            ids = rng.sample(range(8), 2)
            got = pool.get_many([key(i) for i in ids])
            hit = pool.get_into([key(i) for i in ids], into)
            for i, obj, h, buf in zip(ids, got, hit, into):
                if obj is not None and not torch.equal(obj, content(i)):
                    errors.append(f"get_many returned wrong bytes for {i}")
                if h and not torch.equal(buf, content(i)):
                    errors.append(f"get_into returned wrong bytes for {i}")

    threads = [threading.Thread(target=writer, args=(1,)), threading.Thread(target=writer, args=(2,)),
               threading.Thread(target=reader, args=(3,))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    # Every slot is accounted for: held ones plus free ones.
    held = len(pool.keys())
    assert held == pool.stats.blocks and pool.free_bytes() == (4 - held) * SLOT


def test_cpu_pool_is_pinned_exactly_when_cuda_is_present():
    assert CpuTier(SLOT, SLOT).pinned == torch.cuda.is_available()
    assert not CpuTier(SLOT, SLOT, pin=False).pinned
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError):  # asked for explicitly, pinning has nothing to pin for
            CpuTier(SLOT, SLOT, pin=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_pool_loads_into_gpu_buffers():
    pool = CpuTier(4 * SLOT, SLOT)
    assert pool._pool.is_pinned()
    pool.put_many([key(1), key(2)], [content(1).cuda(), content(2)])
    outs = [torch.empty(SLOT, dtype=torch.uint8, device="cuda") for _ in range(2)]
    # Async copies out of pinned slots complete before get_into returns.
    assert pool.get_into([key(1), key(2)], outs) == [True, True]
    pool.delete_many([key(1), key(2)])
    pool.put_many([key(3), key(4)], [content(3), content(4)])
    assert torch.equal(outs[0].cpu(), content(1)) and torch.equal(outs[1].cpu(), content(2))
