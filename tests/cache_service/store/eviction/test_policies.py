"""Eviction policies: registry, pins, each policy's characteristic behaviour
(the property test and the O(1) check: test_eviction_properties.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from cache_service.store.eviction import POLICIES, EvictionPolicy, make_policy
from cache_service.store.eviction.arc import ARCPolicy
from cache_service.store.eviction.lfu import LFUPolicy
from cache_service.store.eviction.lru import LRUPolicy
from cache_service.store.eviction.s3fifo import S3FIFOPolicy
from tiers.types import BlockHash, ConfigError


def H(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "big"))


def no_pins(h: BlockHash) -> bool:
    return False


def access(policy: EvictionPolicy, h: BlockHash, capacity: int, pinned=no_pins) -> BlockHash | None:
    """What the store does for one block: a hit touches it; a miss evicts
    first when the tier is full, then inserts. Returns the victim, if any."""
    if h in policy:
        policy.touch(h)
        return None
    v = policy.victim(pinned) if len(policy) >= capacity else None
    policy.insert(h)
    return v


# ---------------------------------------------------------------- registry
def test_registry_builds_every_policy_by_name():
    for name in POLICIES:
        # each name yields a fresh, empty policy of that name
        p = make_policy(name, 8)
        assert isinstance(p, EvictionPolicy) and p.name == name and len(p) == 0
    assert set(POLICIES) == {"lru", "lfu", "s3fifo", "arc"}


def test_registry_imports_a_policy_module_on_first_use():
    # a fresh interpreter: importing the package loads no policy module
    code = (
        "import sys, cache_service.store.eviction as e\n"
        "mods = lambda: {m for m in sys.modules if m.startswith('cache_service.store.eviction.')}\n"
        "assert mods() == {'cache_service.store.eviction.base'}, mods()\n"
        "e.make_policy('arc', 4)\n"
        "assert mods() == {'cache_service.store.eviction.base', 'cache_service.store.eviction.arc'}, mods()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_unknown_policy_names_the_key_and_the_choices():
    # the default key, then the key the config layer passes
    with pytest.raises(ConfigError, match=r"eviction_policy='mru'.*lru, lfu, s3fifo, arc"):
        make_policy("mru", 8)
    with pytest.raises(ConfigError, match=r"tiers\.cpu\.policy='LRU '"):
        make_policy("LRU ", 8, key="tiers.cpu.policy")


@pytest.mark.parametrize("capacity", [0, -3, 2.5, True, "8"])
def test_capacity_must_be_a_positive_int(capacity):
    for name in POLICIES:
        with pytest.raises(ConfigError, match="capacity_blocks"):
            make_policy(name, capacity)


# ------------------------------------------------- behaviour every policy has
@pytest.mark.parametrize("name", POLICIES)
def test_pinned_blocks_are_never_victims(name):
    # ten resident blocks, the even ones pinned
    p = make_policy(name, 10)
    for i in range(10):
        p.insert(H(i))
    pinned = {H(i) for i in range(0, 10, 2)}
    # draining returns exactly the odd blocks, then nothing
    drained = [p.victim(pinned.__contains__) for _ in range(6)]
    assert drained[-1] is None and sorted(drained[:-1]) == [H(i) for i in range(1, 10, 2)]
    # the pinned ones are all still resident
    assert len(p) == 5 and all(h in p for h in pinned)


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("pins", [None, {3, 4}])
def test_victims_in_a_batch_are_those_victim_gives_one_by_one(name, pins):
    # two policies in the same state: twelve blocks, some of them hit since
    one, batch = make_policy(name, 12), make_policy(name, 12)
    for p in (one, batch):
        for i in range(12):
            p.insert(H(i))
        for i in (2, 7, 9):
            p.touch(H(i))
    pinned = (lambda h: int.from_bytes(h, "big") in pins) if pins else None
    # five victims at once are the five one-by-one calls give, in order, and both keep the same rest
    assert batch.victims(5, pinned) == [one.victim(pinned or no_pins) for _ in range(5)]
    assert len(batch) == len(one) == 7 and all((H(i) in batch) == (H(i) in one) for i in range(12))
    # asked for more than there are: every unpinned block, then nothing
    left = batch.victims(20, pinned)
    assert len(left) == 7 - len(pins or ()) and batch.victims(3, pinned) == []


@pytest.mark.parametrize("name", POLICIES)
def test_victim_is_none_when_everything_is_pinned_and_state_is_kept(name):
    # nothing resident: no victim
    p = make_policy(name, 6)
    assert p.victim(no_pins) is None
    # six blocks, some hit, all pinned: repeated calls give None and lose nothing
    for i in range(6):
        p.insert(H(i))
    p.touch(H(1))
    p.touch(H(4))
    for _ in range(3):
        assert p.victim(lambda h: True) is None
    assert len(p) == 6 and all(H(i) in p for i in range(6))
    # unpinning one block makes exactly that block the victim
    assert p.victim(lambda h: h != H(3)) == H(3)
    assert H(3) not in p and len(p) == 5


@pytest.mark.parametrize("name", POLICIES)
def test_remove_and_touch_of_absent_blocks_are_no_ops(name):
    p = make_policy(name, 4)
    # on an empty policy
    p.remove(H(1))
    p.touch(H(1))
    assert len(p) == 0 and H(1) not in p
    # on a populated one; a removed block is never a victim afterwards
    for i in range(4):
        p.insert(H(i))
    p.remove(H(2))
    p.remove(H(2))
    p.remove(H(99))
    p.touch(H(99))
    assert len(p) == 3 and H(2) not in p and H(99) not in p
    drained = {p.victim(no_pins) for _ in range(3)}
    assert drained == {H(0), H(1), H(3)} and p.victim(no_pins) is None


@pytest.mark.parametrize("name", POLICIES)
def test_inserting_a_resident_block_again_does_not_duplicate_it(name):
    # the same block inserted twice is one resident block
    p = make_policy(name, 4)
    p.insert(H(7))
    p.insert(H(7))
    assert len(p) == 1
    # evicting it once leaves nothing behind
    assert p.victim(no_pins) == H(7)
    assert len(p) == 0 and H(7) not in p and p.victim(no_pins) is None


# ------------------------------------------------------------------ LRU
def test_lru_evicts_least_recently_used():
    # a, b, c arrive in order; a is read again
    p = LRUPolicy(3)
    for i in range(3):
        p.insert(H(i))
    p.touch(H(0))
    # victims follow recency: b, c, then a
    assert [p.victim(no_pins) for _ in range(3)] == [H(1), H(2), H(0)]


def test_lru_counts_a_pinned_block_passed_over_as_recently_used():
    # a, b, c in order; a is pinned when the first victim is chosen
    p = LRUPolicy(3)
    for i in range(3):
        p.insert(H(i))
    assert p.victim(lambda h: h == H(0)) == H(1)
    # once unpinned, a went to the recent end: c is older now
    assert [p.victim(no_pins) for _ in range(2)] == [H(2), H(0)]


def test_lru_loses_a_working_set_to_a_scan():
    # the contrast case for ARC's scan resistance below: same trace, LRU
    cap, working = 10, [H(i) for i in range(6)]
    p = LRUPolicy(cap)
    for _ in range(5):
        for h in working:
            access(p, h, cap)
    for i in range(100, 150):
        access(p, H(i), cap)
    assert not any(h in p for h in working)


# ------------------------------------------------------------------ LFU
def test_lfu_keeps_a_hot_block_under_a_scan():
    # a block read twenty times, then a scan of one-time blocks
    cap = 8
    p = LFUPolicy(cap)
    access(p, H(0), cap)
    for _ in range(20):
        access(p, H(0), cap)
    victims = [access(p, H(i), cap) for i in range(100, 200)]
    # the scan evicted only its own blocks, oldest first
    assert H(0) in p
    assert [v for v in victims if v is not None] == [H(i) for i in range(100, 193)]


def test_lfu_ages_out_a_formerly_hot_block():
    def run(policy: LFUPolicy) -> BlockHash | None:
        # block 0 is hot for a long time, then never read again
        policy.insert(H(0))
        for _ in range(1000):
            policy.touch(H(0))
        # blocks 1..3 become the working set for a while
        for i in (1, 2, 3):
            policy.insert(H(i))
        for _ in range(200):
            for i in (1, 2, 3):
                policy.touch(H(i))
        return policy.victim(no_pins)

    # with aging (every 40 accesses) the old hot block is the victim now
    assert run(LFUPolicy(4)) == H(0)
    # without aging in reach it would still out-count the working set
    assert run(LFUPolicy(4, aging_period=10**9)) == H(1)


def test_lfu_breaks_ties_by_arrival():
    # equal counts: the block that reached the count first goes first
    p = LFUPolicy(4)
    for i in range(3):
        p.insert(H(i))
    p.touch(H(1))
    p.touch(H(0))
    assert [p.victim(no_pins) for _ in range(3)] == [H(2), H(1), H(0)]


def test_lfu_rejects_a_non_positive_aging_period():
    with pytest.raises(ConfigError, match="aging_period"):
        LFUPolicy(4, aging_period=0)


# ------------------------------------------------------------------ S3-FIFO
def _s3fifo_with_hot_set(capacity_hint: int, cap: int = 10) -> S3FIFOPolicy:
    p = S3FIFOPolicy(capacity_hint)
    # five blocks read three times each while they are new
    for i in range(5):
        for _ in range(3):
            access(p, H(i), cap)
    return p


@pytest.mark.parametrize("capacity_hint", [10, 10_000])
def test_s3fifo_one_hit_wonders_leave_through_the_small_queue(capacity_hint):
    # a tier of 10 blocks (the hint may over-estimate it) with a hot set
    cap = 10
    p = _s3fifo_with_hot_set(capacity_hint, cap)
    # a long scan of blocks read once each
    for i in range(100, 300):
        v = access(p, H(i), cap)
        # each victim is a scan block, evicted from S into the ghost queue
        assert v is None or (v >= H(100) and p.queue_of(v) == "ghost")
    # the hot set was promoted to M and survived
    assert all(p.queue_of(H(i)) == "main" for i in range(5))
    # the ghost queue stays within M's share of the real tier size
    assert p.ghost_count() == p.ghost_capacity == cap - 1


def test_s3fifo_reinserted_ghost_goes_to_main_and_stays():
    cap = 10
    p = _s3fifo_with_hot_set(cap, cap)
    # fill up with scan blocks; block 100 is evicted and remembered
    victims = [access(p, H(i), cap) for i in range(100, 110)]
    assert H(100) in victims and p.queue_of(H(100)) == "ghost"
    # it comes back: straight into M, while a first-timer lands in S
    access(p, H(100), cap)
    access(p, H(500), cap)
    assert p.queue_of(H(100)) == "main" and p.queue_of(H(500)) == "small"
    # another scan evicts the first-timer but not the returned block
    for i in range(600, 650):
        access(p, H(i), cap)
    assert p.queue_of(H(100)) == "main" and H(500) not in p


def test_s3fifo_main_queue_gives_read_blocks_another_round():
    # x, y, z each read once in S: the next eviction promotes all three to M
    p = S3FIFOPolicy(10)
    for i in range(3):
        p.insert(H(i))
        p.touch(H(i))
    assert p.victim(no_pins) == H(0)
    assert p.queue_of(H(1)) == p.queue_of(H(2)) == "main"
    # y is read again in M: z goes before it despite arriving later
    p.touch(H(1))
    assert p.victim(no_pins) == H(2)
    assert p.victim(no_pins) == H(1)


def test_s3fifo_finds_a_block_read_in_small_once_main_is_all_pinned():
    # Twenty pinned blocks have moved on to M; one unpinned block, read once, waits in S (below its share).
    p, pinned = S3FIFOPolicy(20), {H(i) for i in range(20)}
    for i in range(20):
        p.insert(H(i))
    assert p.victim(pinned.__contains__) is None
    p.insert(H(99))
    p.touch(H(99))
    # M is tried first (all pinned), S moves the read block to M: it is the victim of this call, not None.
    assert p.victim(pinned.__contains__) == H(99)


# ------------------------------------------------------------------ ARC
@pytest.mark.parametrize("capacity_hint", [10, 10_000])
def test_arc_keeps_the_frequent_set_through_a_one_time_scan(capacity_hint):
    # a tier of 10 blocks; six blocks looped over become frequent (T2)
    cap, working = 10, [H(i) for i in range(6)]
    p = ARCPolicy(capacity_hint)
    for _ in range(5):
        for h in working:
            access(p, h, cap)
    assert all(p.list_of(h) == "t2" for h in working)
    # a one-time scan of 50 blocks passes through T1 only
    for i in range(100, 150):
        assert access(p, H(i), cap) not in working
    # the working set is all still resident (LRU lost all of it, see above)
    assert all(h in p for h in working)
    # history stays bounded by the real tier size
    assert p.ghost_count() <= cap


def test_arc_adapts_p_to_ghost_hits():
    cap = 4
    p = ARCPolicy(cap)
    # a, b read twice (T2); c, d read once (T1); p starts at 0
    for i in (0, 1, 0, 1, 2, 3):
        access(p, H(i), cap)
    assert p.target_t1 == 0
    # e arrives: T1 is over target, so c is evicted and remembered in B1
    assert access(p, H(4), cap) == H(2) and p.list_of(H(2)) == "b1"
    # c returns: a B1 hit means T1 was too small -> p grows; c joins T2
    assert access(p, H(2), cap) == H(3)
    assert p.target_t1 == 1 and p.list_of(H(2)) == "t2"
    # f arrives with |T1| == p: T2's least recent (a) is evicted into B2
    assert access(p, H(5), cap) == H(0) and p.list_of(H(0)) == "b2"
    # a returns: a B2 hit means T2 was too small -> p shrinks back to 0
    access(p, H(0), cap)
    assert p.target_t1 == 0 and p.list_of(H(0)) == "t2"
