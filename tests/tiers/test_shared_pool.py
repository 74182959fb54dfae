"""A slot pool in shared memory: slots reserved for another process to
write, published or handed back; the pool seen through a second mapping of
its memfd; loads that hash each copy while it is still in cache."""
from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch
import xxhash

from tiers.cpu import CpuTier
from tiers import host_copy
from tiers.host_copy import FUSE_BYTES, copy_hashed
from tiers.types import BlockHash, CapacityError, ConfigError

SLOT = 5000  # not a page multiple: rows are a page apart all the same


def key(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def mapped(pool: CpuTier) -> torch.Tensor:
    """The pool as another process maps it: from its fd, rows a stride apart."""
    mm = mmap.mmap(pool.share_fd, pool.num_slots * pool.slot_stride, flags=mmap.MAP_SHARED)
    return torch.frombuffer(mm, dtype=torch.uint8).view(pool.num_slots, pool.slot_stride)[:, :pool.slot_bytes]


def test_another_mapping_writes_reserved_slots_and_the_pool_publishes_them():
    pool = CpuTier(4 * SLOT, SLOT, shared=True)
    assert pool.slot_stride % mmap.PAGESIZE == 0 and pool.verify_payload
    # two of three hashes get slots; one is held already
    pool.put_many([key(0)], [torch.full((SLOT,), 7, dtype=torch.uint8)])
    slots = pool.reserve([key(0), key(1), key(2)], SLOT)
    assert slots[0] is None and None not in slots[1:] and pool.free_bytes() == SLOT
    # another mapping writes them; the pool publishes them as those blocks
    rows = mapped(pool)
    rows[slots[1]].fill_(1)
    rows[slots[2]].fill_(2)
    assert pool.publish([key(1), key(2)], slots[1:], SLOT) == [True, True]
    got = pool.get_many([key(1), key(2)])
    assert torch.all(got[0] == 1) and torch.all(got[1] == 2)


def test_unreserved_and_raced_slots_go_back_to_the_free_list():
    pool = CpuTier(4 * SLOT, SLOT, shared=True)
    # handed back unwritten: free again
    slots = pool.reserve([key(1), key(2)], SLOT)
    pool.unreserve(slots)
    assert pool.free_bytes() == 4 * SLOT
    # a put of the same hash lands first: the publish loses and frees its slot
    slot = pool.reserve([key(3)], SLOT)[0]
    pool.put_many([key(3)], [torch.zeros(SLOT, dtype=torch.uint8)])
    assert pool.publish([key(3)], [slot], SLOT) == [False]
    assert pool.free_bytes() == 3 * SLOT and pool.stats.blocks == 1


def test_reserving_sizes_a_lazy_pool_and_refuses_objects_that_cannot_fit():
    pool = CpuTier(4 * SLOT, None, shared=True)
    assert pool.reserve([], SLOT) == [] and pool.slot_bytes == SLOT and pool.share_fd >= 0
    with pytest.raises(CapacityError):
        pool.reserve([key(1)], SLOT + 1)
    # close hands the fd back
    pool.close()
    assert pool.share_fd == -1


def test_a_shared_pool_is_never_page_locked():
    with pytest.raises(ConfigError):
        CpuTier(4 * SLOT, SLOT, pin=True, shared=True)
    assert not CpuTier(4 * SLOT, SLOT, shared=True).pinned


def test_get_into_hashes_each_copy():
    pool = CpuTier(4 * SLOT, SLOT, shared=True)
    objs = [torch.randint(0, 256, (SLOT,), dtype=torch.uint8) for _ in range(3)]
    pool.put_many([key(i) for i in range(3)], objs)
    outs = [torch.empty(SLOT, dtype=torch.uint8) for _ in range(4)]
    # one hash per hit (of its bytes past the first 100), None for the miss; the bytes are copied all the same
    got = pool.get_into([key(0), key(9), key(1), key(2)], outs, hash_from=100)
    assert got[1] is None
    assert [got[0], got[2], got[3]] == [xxhash.xxh3_64_intdigest(o.numpy()[100:]) for o in objs]
    assert torch.equal(outs[0], objs[0]) and torch.equal(outs[3], objs[2])


@pytest.mark.parametrize("size", [100, FUSE_BYTES // 3, 2 * FUSE_BYTES + 5])
@pytest.mark.parametrize("skip", [0, 128])
@pytest.mark.parametrize("in_c", [True, False])
def test_copy_hashed_copies_and_hashes_as_the_separate_steps_do(size, skip, in_c, monkeypatch):
    # the C call must be there (with the xxhash package's XXH3); the Python loop is the reference
    assert host_copy.XXH3 and host_copy.copy_hash_many is not None
    if not in_c:
        monkeypatch.setattr(host_copy, "XXH3", 0)
    # small copies one by one, a large one in pieces: the same bytes and the same xxh3 as one-shot hashing
    srcs = [torch.randint(0, 256, (size,), dtype=torch.uint8).numpy() for _ in range(5)]
    dsts = [np.empty(size + 7, dtype=np.uint8) for _ in range(5)]
    sums = copy_hashed(dsts, srcs, skip)
    assert sums == [xxhash.xxh3_64_intdigest(s[skip:]) for s in srcs]
    assert all((d[:size] == s).all() for d, s in zip(dsts, srcs))
