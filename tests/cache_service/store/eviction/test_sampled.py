"""The "sampled" policy over a real disk tier: exact LRU while the tier is
small, the oldest of random draws past that, pins respected, and a store
that opens without walking the tier's keys."""
from __future__ import annotations

import pytest
import torch
import xxhash

from cache_service.blocks.keys import Namespace, prefix_hashes
from cache_service.config import load_config
from cache_service.factory import open_store
from cache_service.store.eviction import make_policy
from tiers import disk_recency
from tiers.cpu import CpuTier
from tiers.disk import DiskTier
from tiers.types import ConfigError

MB = 1 << 20


def no_pins(h) -> bool:
    return False


def filled(tmp_path, n: int) -> tuple[DiskTier, list[bytes]]:
    tier = DiskTier(tmp_path, 64 * MB, fsync=False)
    hs = [xxhash.xxh3_128_digest(i.to_bytes(8, "little")) for i in range(n)]  # uniform, as block hashes are
    for a in range(0, n, 512):
        tier.put_many(hs[a:a + 512], [torch.full((64,), i % 251, dtype=torch.uint8) for i in range(a, min(n, a + 512))])
    return tier, hs


def test_small_tier_evicts_in_exact_lru_order(tmp_path):
    tier, hs = filled(tmp_path, 40)
    pol = make_policy("sampled", 40, source=tier)
    # Blocks 0..9 read again (most recent now); the store reports the hits.
    tier.get_many(hs[:10])
    for h in hs[:10]:
        pol.touch(h)
    # Victims come oldest first: 10..39, then the re-read ones in their read order.
    got = [pol.victim(no_pins) for _ in range(40)]
    assert got == hs[10:] + hs[:10]
    assert pol.victim(no_pins) is None
    tier.close()


def test_a_block_read_after_the_pool_was_filled_is_not_the_next_victim(tmp_path):
    tier, hs = filled(tmp_path, 20)
    pol = make_policy("sampled", 20, source=tier)
    assert pol.victim(no_pins) == hs[0]  # the pool now holds the next oldest
    tier.delete_many([hs[0]])
    # Block 1 is read: it leaves the pool and gets a new access time.
    tier.get_many([hs[1]])
    pol.touch(hs[1])
    assert pol.victim(no_pins) == hs[2]
    tier.close()


def test_pinned_blocks_are_passed_over_and_all_pinned_is_none(tmp_path):
    tier, hs = filled(tmp_path, 12)
    pol = make_policy("sampled", 12, source=tier)
    pinned = set(hs[::2])
    # Only the unpinned ones come out, oldest first, then nothing.
    got = [pol.victim(pinned.__contains__) for _ in range(7)]
    assert got == hs[1::2] + [None]
    assert len(pol) == 12 and all(h in pol for h in pinned)
    tier.close()


def test_many_pinned_oldest_blocks_do_not_hide_the_evictable_ones(tmp_path):
    # The oldest 2,100 of 3,000 blocks belong to idle pinned sessions: the 900 others are still evictable.
    tier, hs = filled(tmp_path, 3000)
    pol = make_policy("sampled", 3000, source=tier)
    pinned = set(hs[:2100])
    # The first victim is found (the policy gave up after 2,048 pinned candidates), and so are later ones.
    assert pol.victim(pinned.__contains__) == hs[2100]
    assert pol.victims(4, pinned.__contains__) == hs[2101:2105]
    # Unpinned, the old ones are candidates again (after the candidates already drawn).
    assert hs[0] in pol.victims(64, lambda h: False)
    tier.close()


def test_past_the_exact_range_victims_are_among_the_oldest(tmp_path):
    n = disk_recency.EXACT_LRU + 2000
    tier, hs = filled(tmp_path, n)  # put in order: hs[i] is the i-th oldest
    tier._atimes._rng.seed(7)
    pol = make_policy("sampled", n, source=tier)
    # 300 victims, each the oldest of its random draws: nearly all from the oldest fifth.
    got = [pol.victim(no_pins) for _ in range(300)]
    rank = {h: i for i, h in enumerate(hs)}
    assert len(set(got)) == 300
    old = sum(rank[h] < n // 5 for h in got)
    print(f"victims among the oldest fifth: {old}/300")
    assert old >= 0.95 * 300
    tier.close()


def test_the_policy_needs_a_tier_with_access_times():
    with pytest.raises(ConfigError, match="access times"):
        make_policy("sampled", 8, source=CpuTier(MB, slot_bytes=4096))
    with pytest.raises(ConfigError, match="policy"):
        load_config(env={}, overrides={"tiers": {"cpu": {"capacity": "1MiB", "policy": "nope"}}})


def test_the_store_opens_a_disk_tier_without_walking_its_keys(tmp_path, monkeypatch):
    ns = Namespace("sampled-store", "float32", num_layers=1, kv_heads=1, head_dim=8, block_tokens=4)
    cfg = load_config(env={}, overrides={"tiers": {"cpu": {"capacity": "1MiB"},
                                                   "disk": {"path": str(tmp_path), "capacity": "48KiB",
                                                            "fsync": False}}})
    assert cfg.tiers.disk.policy == "sampled"
    hs = prefix_hashes(ns, range(4 * 200))
    payloads = [torch.full(ns.block_shape, float(i)) for i in range(200)]
    with open_store(cfg) as store:
        store.store(ns, hs, payloads)
        assert store.flush(60)
    # Reopened: nothing asks the disk tier for every key.
    monkeypatch.setattr(DiskTier, "keys", lambda self: pytest.fail("keys() walked at open"))
    with open_store(cfg) as store:
        disk = store.tiers[1]
        assert disk.stats.blocks > 0 and disk.stats.used_bytes <= 48 * 1024
        # More blocks than fit: the oldest go, the newest stay, every survivor reads back exact.
        more = prefix_hashes(ns, range(10_000, 10_000 + 4 * 50))
        store.store(ns, more, payloads[:50])
        assert store.flush(60)
        assert disk.stats.used_bytes <= 48 * 1024 and disk.contains_many(more[-5:]) == [True] * 5
        assert store.stats()["disk"]["evictions"] > 0
        got = store.load(ns, more[-5:])
        assert all(torch.equal(g, p) for g, p in zip(got, payloads[45:50]))
