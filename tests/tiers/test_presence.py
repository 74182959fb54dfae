"""PresenceTable against a Python set: random adds, discards and lookups,
through growth and tombstones, and keys overflowing a bucket; the C lookup
(tiers/_presence.c) and the numpy one give the same answers, and so do the
C insert and the numpy one."""
from __future__ import annotations

import random

import numpy as np
import pytest
import xxhash

from tiers import presence
from tiers.presence import PresenceTable, keys_of


def held_keys(table: PresenceTable) -> set[int]:
    return set(table._buckets[table._buckets > 1].tolist())


def both_ways(table: PresenceTable, ask: list[bytes]) -> list[bool]:
    """The table's answers, checked equal through the C lookup and the numpy one."""
    got = table.contains(ask)
    assert got == table._find(keys_of(ask))[0].tolist()
    return got


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
        assert both_ways(table, ask) == [a in truth for a in ask], step
        assert len(table) == len(truth)
    # It grew past its first size, and every held hash is still found.
    assert table.nbytes > 4096 * 8 and all(both_ways(table, list(truth)))


def test_keys_sharing_a_bucket_overflow_past_it_and_past_tombstones():
    table = PresenceTable()
    # Hashes whose first 8 bytes differ only above the bucket bits: one home bucket for 20 keys,
    # so 12 of them spill into the buckets after it.
    same_bucket = [(k << 40).to_bytes(8, "little") + bytes(8) for k in range(1, 21)]
    table.add(same_bucket)
    assert both_ways(table, same_bucket) == [True] * 20
    # Keys not held whose home bucket is that full one are looked for past it, and missed.
    strangers = [(k << 40).to_bytes(8, "little") + bytes(8) for k in range(21, 25)]
    assert both_ways(table, strangers) == [False] * 4
    # A discard in the home bucket leaves the spilled ones reachable.
    table.discard(same_bucket[2:3])
    assert both_ways(table, same_bucket) == [True, True, False] + [True] * 17
    # A discard of a spilled key leaves the others found; adding both back refills the tombstones.
    table.discard(same_bucket[15:16])
    assert both_ways(table, same_bucket).count(False) == 2 and len(table) == 18
    table.add(same_bucket[2:3] + same_bucket[15:16])
    assert both_ways(table, same_bucket) == [True] * 20 and len(table) == 20


def test_the_c_insert_holds_what_the_numpy_one_holds(monkeypatch):
    rng, by_c, by_numpy = random.Random(5), PresenceTable(), PresenceTable()
    monkeypatch.setattr(presence, "_add", None)  # the reference table: numpy all through, its growth too
    from tiers._presence import add as c_add  # built wherever the project installs (scripts/install.sh checks it)
    by_c._add_keys = lambda keys, _: PresenceTable._add_keys(by_c, keys, c_add)
    for step in range(200):
        # The same batches (repeats within them, keys held already) into both, by C and by numpy.
        add = [h(rng.randrange(5_000)) for _ in range(rng.randrange(1, 300))]
        by_c.add(add)
        by_numpy.add(add)
        # Discards leave tombstones that later inserts reuse.
        gone = [h(rng.randrange(5_000)) for _ in range(rng.randrange(0, 100))]
        by_c.discard(gone)
        by_numpy.discard(gone)
        # Same keys held; each table's counts of live and used slots are its buckets' own.
        assert held_keys(by_c) == held_keys(by_numpy), step
        for t in (by_c, by_numpy):
            assert (len(t), t._used) == (len(held_keys(t)), int((t._buckets != 0).sum())), step
    # Both grew past their first size (the numpy one by numpy alone).
    assert by_c.nbytes > 4096 * 8 and by_numpy.nbytes > 4096 * 8
    # A key discarded and added again takes its tombstone back: no empty slot used up.
    for t in (by_c, by_numpy):
        t.add([h(9_999_999)])
        used = t._used
        t.discard([h(9_999_999)])
        t.add([h(9_999_999)])
        assert t._used == used and len(held_keys(t)) == len(t)
    # The C insert refuses a table with no room rather than loop, and keys that mark empty or gone slots.
    full = PresenceTable()
    full._buckets[:] = 7
    with pytest.raises(RuntimeError, match="full"):
        c_add(full._buckets, keys_of([h(1)]))
    for marker in (0, 1):
        with pytest.raises(ValueError, match="at least 2"):
            c_add(PresenceTable()._buckets, np.array([marker], dtype=np.uint64))


def test_the_c_lookup_is_built_and_takes_any_bytes_like_hash():
    # setup.py builds it wherever a C compiler is (scripts/install.sh checks the import).
    from tiers import _presence

    table = PresenceTable()
    table.add([h(1)])
    assert _presence.contains(table._buckets, [bytearray(h(1)), memoryview(h(2)), h(1)]) == [True, False, True]


def test_sized_for_millions_at_about_sixteen_to_twentytwo_bytes_each():
    # Sized at open from the index's record count: no rehash while it fills to that.
    table = PresenceTable(expected=3_000_000)
    assert table.nbytes / 3_000_000 <= 24
