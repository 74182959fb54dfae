"""The longest prefix of a request's blocks that a store's tiers hold between them."""
from __future__ import annotations

from typing import Callable, Sequence

from tiers.base import Tier
from tiers.types import BlockHash


def held_prefix(hashes: Sequence[BlockHash], tiers: Sequence[Tier], asked: list[tuple[int, list[bool]]]) -> int:
    """The longest prefix of `hashes` that the tiers hold between them. Each
    tier is asked once, top down, only about the hashes from the first
    position no tier asked so far holds; `asked` gets (offset, answers) per
    tier asked. The prefix is walked with list.index, not per hash in Python."""
    n, pos, tiers = len(hashes), 0, iter(tiers)
    while pos < n:
        start = pos
        for at, ans in asked:
            pos = at + _first_miss(ans, pos - at)
        if pos == start:  # those asked agree on a miss here: the next tier down is asked
            tier = next(tiers, None)
            if tier is None:
                break
            asked.append((pos, tier.contains_many(hashes[pos:])))
    return pos


def covered(asked: list[tuple[int, list[bool]]], start: int, end: int) -> list[bool]:
    """Whether any of `asked` (as `held_prefix` leaves it) holds each of positions start..end-1."""
    return [any(ans[j - at] for at, ans in asked if j >= at) for j in range(start, end)]


def chunked_prefix(start: int, end: int, ask: Callable[[int, int], list[bool]], first: int = 32) -> int:
    """Where the run of positions from `start` that `ask(a, b)` answers True
    for (about positions a..b-1) ends, before `end`; asked in chunks that
    double from `first` (the directory, one round trip each): a tail that
    misses early costs one small request, not one about every block of a
    long cold prompt."""
    pos, step = start, first
    while pos < end:
        answers = ask(pos, min(end, pos + step))
        k = _first_miss(answers, 0)
        pos += k
        if k < len(answers):
            break
        step *= 2
    return pos


def _first_miss(answers: list[bool], start: int) -> int:
    try:
        return answers.index(False, start)
    except ValueError:
        return len(answers)

