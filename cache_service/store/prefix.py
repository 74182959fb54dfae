"""The longest prefix of a request's blocks that a store's tiers hold between them."""
from __future__ import annotations

from typing import Sequence

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


def _first_miss(answers: list[bool], start: int) -> int:
    try:
        return answers.index(False, start)
    except ValueError:
        return len(answers)

