"""The disk tier's reusable read buffer: reused only once nothing handed out is alive."""
from __future__ import annotations

import torch

from tiers.arena import Arena, can_count_users


def test_this_torch_counts_a_storages_users():
    # without the count the arena never reuses memory (correct, but every batch faults fresh pages)
    assert can_count_users()


def _base(rows: list[torch.Tensor]) -> int:
    return rows[0].untyped_storage().data_ptr()


def test_rows_are_reused_only_after_every_view_is_dropped():
    arena = Arena()
    # four rows, evenly spaced in one allocation
    rows = arena.rows(4, 1000)
    assert [r.data_ptr() - rows[0].data_ptr() for r in rows] == [0, 1000, 2000, 3000]
    first = _base(rows)
    # a caller still holds one row: the next batch gets other memory, and the held bytes stay as written
    keep = rows[2]
    keep.fill_(7)
    del rows
    other = arena.rows(4, 1000)
    second = _base(other)
    assert second != first
    other[2].fill_(9)
    assert bool((keep == 7).all())
    # once nothing of the newest batch is alive, its memory comes back (a smaller batch fits in it too)
    del other
    assert _base(arena.rows(2, 1000)) == second
    assert _base(arena.rows(4, 1000)) == second


def test_batches_over_the_limit_get_their_own_memory():
    arena = Arena(max_bytes=10_000)
    # an 8 kB batch is kept and reused
    small = arena.rows(2, 4000)
    kept = _base(small)
    del small
    # a 16 kB batch gets memory of its own and does not replace the kept one
    big = arena.rows(4, 4000)
    assert _base(big) != kept
    del big
    assert _base(arena.rows(2, 4000)) == kept
