"""Pins: block pins, session pins shared by forks, the per-tenant cap, expiry, and eviction honouring them."""
from __future__ import annotations

import time

from cache_service.store.pins import PinBook
from tests.cache_service.store.store_helpers import NS, hashes, make_store, payload_for, same
from tiers.types import BlockHash


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def test_a_fork_shares_its_parents_pinned_blocks():
    book = PinBook()
    parent, tail = [h(i) for i in range(4)], [h(i) for i in range(10, 12)]
    # The parent pins its conversation; the sub-agent pins the shared prefix plus its own tail.
    book.pin_session("acme", "parent", parent, 60, block_bytes=100)
    book.pin_session("acme", "child", parent[:2] + tail, 60, block_bytes=100)
    # Distinct blocks are counted once for the tenant.
    assert book.stats()["session_pinned_bytes"] == 600
    # The parent's release leaves the shared prefix pinned by the child, and frees the rest.
    assert book.unpin_session("acme", "parent")
    assert all(book.is_pinned(x) for x in parent[:2] + tail)
    assert not any(book.is_pinned(x) for x in parent[2:])
    # Releasing the child frees everything; a second release says there was nothing.
    assert book.unpin_session("acme", "child") and not book.unpin_session("acme", "child")
    assert not any(book.is_pinned(x) for x in parent + tail)
    assert book.stats()["session_pinned_bytes"] == 0


def test_past_the_tenant_cap_the_oldest_session_pin_yields():
    book = PinBook(cap_bytes=1000)
    # Two sessions of 4 blocks of 100 bytes fit; the third pushes the tenant over its cap.
    book.pin_session("acme", "s1", [h(i) for i in range(4)], None, 100)
    book.pin_session("acme", "s2", [h(i) for i in range(10, 14)], None, 100)
    assert book.pin_session("other", "s9", [h(i) for i in range(30, 38)], None, 100) == []  # another tenant's
    yielded = book.pin_session("acme", "s3", [h(i) for i in range(20, 24)], None, 100)
    # The oldest (s1) yielded; the asking session and s2 still hold; it is counted.
    assert yielded == ["s1"]
    assert not book.is_pinned(h(0)) and book.is_pinned(h(10)) and book.is_pinned(h(20))
    assert book.stats()["pins_yielded"] == 1
    assert set(book.session_pins("acme")) == {"s2", "s3"} and set(book.session_pins("other")) == {"s9"}
    # A session alone over the cap still holds its pin (the request that made it succeeds).
    assert book.pin_session("solo", "big", [h(i) for i in range(100, 120)], None, 100) == []
    assert book.is_pinned(h(100))


def test_an_expired_pin_never_pushes_a_live_one_out_past_the_cap():
    book = PinBook(cap_bytes=1000)
    # A live pin, and one that has just expired (nothing has swept it yet).
    book.pin_session("acme", "live", [h(i) for i in range(4)], None, 100)
    book.pin_session("acme", "short", [h(i) for i in range(10, 14)], 0.01, 100)
    time.sleep(0.02)
    # A third fits beside the live one: the expired pin goes, the live one stays.
    assert book.pin_session("acme", "new", [h(i) for i in range(20, 24)], None, 100) == []
    assert set(book.session_pins("acme")) == {"live", "new"}


def test_a_block_pinned_under_two_sizes_is_released_with_the_size_it_counted():
    book = PinBook()
    # Two sessions pin the same keys under namespaces of different block sizes.
    book.pin_session("acme", "a", [h(1)], None, 100)
    book.pin_session("acme", "b", [h(1)], None, 4060)
    assert book.stats()["session_pinned_bytes"] == 100
    # Released in either order, the tenant's pinned bytes come back to zero (they stayed at 3,960, or -3,960).
    assert book.unpin_session("acme", "a") and book.unpin_session("acme", "b")
    assert book.stats()["session_pinned_bytes"] == 0


def test_a_session_repin_replaces_its_pin_and_pins_expire():
    book = PinBook()
    book.pin_session("", "s", [h(1), h(2)], 60, 10)
    # The next turn re-pins the grown conversation: the old pin is replaced, not stacked.
    book.pin_session("", "s", [h(1), h(2), h(3)], 0.2, 10)
    assert book.stats()["session_pinned_bytes"] == 30
    # Past its TTL the pin is gone (block pins expire likewise).
    book.pin([h(9)], ttl_s=0.2)
    time.sleep(0.25)
    book._next_expiry_check = 0.0
    assert not book.is_pinned(h(1)) and not book.is_pinned(h(9))
    assert book.session_pins("") == {}


def test_a_tenants_block_pins_are_capped_and_the_oldest_yield():
    # block pins count against the tenant's cap as session pins do (4 blocks of 100 bytes here)
    book = PinBook(cap_bytes=400, typical_bytes=lambda: 100)
    assert book.pin([h(i) for i in range(3)], tenant="acme") == 0
    # a call past the cap: the oldest of the tenant's block pins yield, this call's own included
    assert book.pin([h(i) for i in range(10, 13)], tenant="acme") == 2
    assert [book.is_pinned(h(i)) for i in (0, 1, 2, 10, 11, 12)] == [False, False, True, True, True, True]
    # another tenant's pins are counted apart: acme's cap does not touch them
    assert book.pin([h(20)], tenant="globex") == 0 and book.is_pinned(h(20))
    # one call of more than the cap keeps its newest blocks only
    assert book.pin([h(i) for i in range(30, 40)], tenant="acme") == 10
    assert [x for x in range(30, 40) if book.is_pinned(h(x))] == [36, 37, 38, 39]
    assert book.stats()["pins_yielded"] == 12


def test_a_claimed_small_block_counts_what_the_stores_blocks_take():
    # a session pin names its namespace; a namespace of tiny blocks cannot fit more real blocks under the cap
    book = PinBook(cap_bytes=1000, typical_bytes=lambda: 400)
    book.pin_session("acme", "a", [h(1), h(2)], None, block_bytes=1)
    assert book.stats()["session_pinned_bytes"] == 800
    assert book.pin_session("acme", "b", [h(3), h(4)], None, block_bytes=1) == ["a"]


def test_expired_block_pins_leave_though_nobody_asks_about_them():
    # pins on blocks no eviction ever looks at still expire: the book does not grow for good,
    # and once they are gone evictions need not ask about pins at all
    book = PinBook(typical_bytes=lambda: 100)
    book.pin([h(i) for i in range(1000)], ttl_s=0.01, tenant="acme")
    time.sleep(0.05)
    assert book.stats()["pinned_blocks"] == 0 and not book.any()


def test_eviction_passes_over_session_pinned_blocks_and_prefetch_brings_blocks_up(tmp_path):
    # A CPU tier of 8 blocks over a disk tier.
    store = make_store(tmp_path, cpu_blocks=8)
    keep = hashes(3, start=10_000)
    store.store(NS, keep, [payload_for(x) for x in keep])
    # A session pins its blocks; 60 blocks of other traffic stream through.
    store.pins.pin_session("", "agent", keep, 60, NS.payload_bytes)
    for i in range(0, 60, 10):
        hs = hashes(10, start=i)
        store.store(NS, hs, [payload_for(x) for x in hs])
    store.flush()
    # The pinned blocks are still in the CPU tier; an early unpinned one went down to disk.
    cpu = store.tiers[0]
    assert cpu.contains_many(keep) == [True] * 3
    early = hashes(2, start=0)
    assert cpu.contains_many(early) == [False, False] and store.lookup(early) == 2
    # A prefetch brings the early blocks back up in the background, checked, whatever their hit counts.
    assert store.prefetch(NS, early) == 2
    store.flush()
    assert cpu.contains_many(early) == [True, True]
    assert all(same(g, payload_for(x)) for g, x in zip(store.load(NS, early), early))
    store.close()


def test_pins_renewed_or_dropped_leave_no_growing_bookkeeping():
    # a client renewing its pins, or pinning and unpinning, keeps the deadlines bounded by the pins held
    book = PinBook(typical_bytes=lambda: 100)
    hashes = [h(i) for i in range(1000)]
    for _ in range(50):
        book.pin(hashes, ttl_s=3600)
    assert len(book._deadlines) <= 2 * 1000 + 64
    for _ in range(50):
        book.pin(hashes, ttl_s=3600)
        book.unpin(hashes)
    assert len(book._deadlines) <= 64 and not book.any()
