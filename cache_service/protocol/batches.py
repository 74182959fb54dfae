"""The one batch splitter: how a call's n blocks are cut into the pieces
that travel (or are checked, or committed) one at a time."""
from __future__ import annotations


def split(n: int, per: int, edge: int | None = None) -> list[range]:
    """Positions 0..n-1 in ranges of `per` (at least 1). With `edge`, the
    first and the last range hold only `edge` positions (a pipeline's ends:
    the first answers soon, the last, which nothing overlaps, is short)."""
    per = max(1, per)
    if edge is None:
        return [range(i, min(n, i + per)) for i in range(0, n, per)]
    edge = max(1, edge)
    if n <= edge:
        return [range(n)]
    cuts = [0, edge]
    while n - cuts[-1] > edge + per:
        cuts.append(cuts[-1] + per)
    if n - cuts[-1] > edge:
        cuts.append(n - edge)
    return [range(a, b) for a, b in zip(cuts, cuts[1:] + [n])]


def per_bytes(budget: int, item_bytes: int) -> int:
    """How many items of `item_bytes` fit in `budget` bytes (at least 1)."""
    return max(1, budget // max(1, item_bytes))
