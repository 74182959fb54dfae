"""PresenceTable against a Python set: random adds, discards and lookups,
through growth and tombstones, and colliding slots."""
from __future__ import annotations

import random

import xxhash

from tiers.presence import PresenceTable


def h(i: int) -> bytes:
    return xxhash.xxh3_128_digest(i.to_bytes(8, "little"))


def test_matches_a_set_through_random_adds_and_discards():
    rng, table, truth = random.Random(3), PresenceTable(), set()
    for step in range(300):
        # A batch added, a batch discarded (some never held), a batch asked.
        add = [h(rng.randrange(20_000)) for _ in range(rng.randrange(1, 400))]
        gone = [h(rng.randrange(20_000)) for _ in range(rng.randrange(1, 300))]
        table.add(add)
        truth.update(add)
        table.discard(gone)
        truth.difference_update(gone)
        ask = [h(rng.randrange(20_000)) for _ in range(256)]
        assert table.contains(ask) == [a in truth for a in ask], step
        assert len(table) == len(truth)
    # It grew past its first size, and every held hash is still found.
    assert table.nbytes > 4096 * 8 and all(table.contains(list(truth)))


def test_keys_sharing_a_slot_probe_past_each_other_and_past_tombstones():
    table = PresenceTable()
    # Hashes whose first 8 bytes differ only above the slot bits: one slot, a probe chain.
    same_slot = [(k << 40).to_bytes(8, "little") + bytes(8) for k in range(1, 9)]
    table.add(same_slot)
    assert table.contains(same_slot) == [True] * 8
    # A discard in the middle of the chain leaves the ones after it reachable.
    table.discard(same_slot[2:3])
    assert table.contains(same_slot) == [True, True, False] + [True] * 5
    table.add(same_slot[2:3])
    assert table.contains(same_slot) == [True] * 8 and len(table) == 8


def test_sized_for_millions_at_about_sixteen_to_twentytwo_bytes_each():
    # Sized at open from the index's record count: no rehash while it fills to that.
    table = PresenceTable(expected=3_000_000)
    assert table.nbytes / 3_000_000 <= 24
