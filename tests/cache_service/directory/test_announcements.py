"""Re-announcements are taken in batches at a bounded rate, most recent list
per location only, and nothing is dropped however many blocks wait."""
from __future__ import annotations

import time

from cache_service.directory.announcements import Announcements


def test_batches_come_at_the_rate_and_nothing_is_dropped():
    a = Announcements(per_s=10_000)
    hashes = [i.to_bytes(16, "big") for i in range(3000)]
    # A disk's worth waits by reference; the first batch goes at once.
    a.add("node-x", hashes)
    first = a.take(1000)
    assert [h for _, _, h in first] == hashes[:1000] and all(add and where == "node-x" for add, where, _ in first)
    # The next batch is due only after 1000 / 10,000 s.
    assert a.take(1000) == [] and 0.05 < a.due_in() <= 0.1
    got, t0 = list(first), time.monotonic()
    while a:
        time.sleep(a.due_in())
        got += a.take(1000)
    # Every block came, in order, in about the time the rate allows.
    assert [h for _, _, h in got] == hashes and time.monotonic() - t0 >= 0.15
    assert a.due_in() is None


def test_a_newer_list_for_a_location_replaces_the_waiting_one():
    a = Announcements(per_s=1e9)
    a.add("node-x", [b"a" * 16, b"b" * 16])
    a.add("s3", [b"c" * 16])
    a.add("node-x", [b"d" * 16])
    assert [(w, h) for _, w, h in a.take(10)] == [("s3", b"c" * 16), ("node-x", b"d" * 16)]
