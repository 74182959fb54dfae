"""The prefix logic every engine connector shares (connectors/engine.py for
our engine, connectors/vllm/ for vLLM).

A sequence's KV is stored in blocks of `ns.block_tokens` tokens, each keyed by
the hash chained over its prefix (`prefix_hashes`), so a block is only usable
after every block before it: a lookup counts the leading blocks held, a load
stops at the first block that is missing or fails its check, and a save
stores the full blocks of a range not stored yet.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence

from cache_service.blocks.keys import Namespace, prefix_hashes
from tiers.types import BlockHash


def block_hashes(ns: Namespace, token_ids: Sequence[int], start: int, end: int, salt: bytes = b"") -> list[BlockHash]:
    """Hashes of the full blocks of tokens [0, end) from the one holding token `start` on
    (`start` is block-aligned wherever a connector asks); `salt`: see `prefix_hashes`."""
    return prefix_hashes(ns, token_ids[:end], salt)[start // ns.block_tokens:]


def full_blocks(ns: Namespace, token_ids: Sequence[int], salt: bytes = b"") -> list[BlockHash]:
    """Hashes of every full block of `token_ids` (what a lookup asks for)."""
    return prefix_hashes(ns, list(token_ids[:len(token_ids) // ns.block_tokens * ns.block_tokens]), salt)


def loaded_prefix(payloads: Sequence[object | None]) -> int:
    """How many leading `payloads` are usable: the first miss (None) ends the prefix."""
    return next((i for i, p in enumerate(payloads) if p is None), len(payloads))


class StoredBlocks:
    """The hashes this connector stored or loaded recently (bounded, least
    recently seen dropped first), so a save skips what the store already has."""

    def __init__(self, remember: int = 1 << 16) -> None:
        self._seen: OrderedDict[BlockHash, None] = OrderedDict()
        self._remember = remember

    def new(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Indices of `hashes` not seen recently."""
        return [i for i, h in enumerate(hashes) if h not in self._seen]

    def forget(self, hashes: Iterable[BlockHash]) -> None:
        """Blocks the store no longer holds (evicted, quarantined, lost): the next save stores them again."""
        for h in hashes:
            self._seen.pop(h, None)

    def add(self, hashes: Iterable[BlockHash]) -> None:
        for h in hashes:
            self._seen[h] = None
            self._seen.move_to_end(h)
        while len(self._seen) > self._remember:
            self._seen.popitem(last=False)
