"""The one batch splitter."""
from cache_service.protocol.batches import per_bytes, split


def test_split_covers_every_position_once_in_order():
    for n in range(0, 50):
        for per in (1, 3, 7, 64):
            for edge in (None, 1, per // 4):
                parts = split(n, per, edge)
                assert [i for r in parts for i in r] == list(range(n))
                assert all(0 < len(r) <= per for r in parts) or n == 0
    assert split(0, 4, edge=1) == [range(0)]  # with edges a first (empty) chunk is always there


def test_split_with_edges_keeps_both_ends_short():
    assert [len(r) for r in split(91, 22, edge=5)] == [5, 22, 22, 22, 15, 5]
    assert [len(r) for r in split(10, 4)] == [4, 4, 2] and split(0, 4) == []
    assert per_bytes(10, 3) == 3 and per_bytes(1, 3) == 1 and per_bytes(5, 0) == 5
