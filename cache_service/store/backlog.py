"""The backlog of an outage: blocks a lower tier (S3, say) refused while it
was down, kept until it is back, and the writer's tick that writes them.

Refused blocks go into the tier's upload journal (journal.py) when it has
one, durable with their bytes; else, or past the journal's bound, their
hashes are remembered in memory (their bytes stay in the tiers above, read
back at retry time). Every path here carries a delete log mark (deletes.py),
so a delete between a block's read and its write still wins.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Sequence

import torch

from cache_service.store.state import StoreState
from cache_service.store.writer import Item
from tiers.types import BlockHash

log = logging.getLogger("tierkv.store")
_MAX_DEFERRED = 1 << 20  # blocks a down tier refused, remembered to write once it is back


class Backlog:
    """What each tier refused while down (`StoreState.deferred` and its
    journal), and the writer tick that writes it once the tier is back.
    `put` is `Placement.put`."""

    def __init__(self, state: StoreState, put: Callable[..., set[BlockHash]]) -> None:
        self.state, self._put = state, put

    def record(self, i: int, items: Sequence[Item], mark: int) -> list[BlockHash]:
        """Record items in tier i's journal; any deleted since `mark` are
        forgotten again (a delete that forgot the journal's entries before
        this record). Returns the hashes recorded."""
        journal = self.state.journals[i]
        kept = journal.record(items)
        gone = self.state.deletes.deleted(mark, kept)
        if gone:
            journal.forget(list(gone))
        return [h for h in kept if h not in gone]

    def defer(self, i: int, items: Sequence[Item], mark: int) -> None:
        """Remember blocks tier i refused while down: in its upload journal
        (durable, with their bytes) when it has one, else, or past the
        journal's bound, their hashes in memory (their bytes stay in the
        tiers above); that set is bounded, the oldest dropped first. Blocks
        deleted since `mark` are not remembered."""
        kept = set(self.record(i, items, mark)) if self.state.journals[i] is not None else set()
        with self.state.meta:  # a delete drops its blocks from the set under meta, after it starts
            later = self.state.deferred[i]
            gone = self.state.deletes.deleted(mark, [h for h, _ in items])
            later.update(dict.fromkeys(h for h, _ in items if h not in kept and h not in gone))
            over = max(0, len(later) - _MAX_DEFERRED)
            for _ in range(over):
                later.popitem(last=False)
        self.state.count(i, deferred=len(items), dropped=over)

    def retry(self, i: int, batch: int = 64, most: int = 4096) -> bool:
        """Writer i's tick: once tier i is available again, write the blocks it
        refused while down: its journal's oldest first, then those remembered
        in memory, read back from the tiers above (one that left them
        meanwhile is lost, counted and logged; one refused again is
        deferred again, and the tick ends). Live writes are not starved: once
        a batch is done and new work waits in the writer's queue, the tick
        ends and returns True (more to do: tick again after the next live
        batch), so an outage's backlog and the live stores behind it take turns."""
        done, journal = 0, self.state.journals[i]
        if self.state.tiers[i].available():
            self.state.tiers[i].tick()
        while done < most and self.state.tiers[i].available():
            if done and self.state.writers[i].depth():
                return bool(self.state.deferred[i]) or bool(journal and len(journal))
            mark = self.state.deletes.mark()  # before the read: a delete after it must still win
            items = self._next(i, batch)
            if items is None:
                return False
            held = self._put(i, items, retry=True, since=mark)
            if journal is not None:
                journal.forget(list(held))
            gone = self.state.deletes.deleted(mark, [h for h, _ in items])
            if len(held) + len(gone) < len(items):
                return False  # refused again (a service still coming back, say): kept for a later tick
            done += max(1, len(items))
        return False

    def _next(self, i: int, batch: int) -> list[Item] | None:
        """The next batch to retry for tier i (None: nothing is waiting)."""
        journal = self.state.journals[i]
        if journal is not None and (hs := journal.oldest(batch)):
            items, missing = journal.read(hs)
            journal.forget(missing)  # gone from its file: not to be retried forever
            self._lost(i, len(missing))
            return items if items or missing else None  # nothing read (a failing read): the next tick tries again
        later = self.state.deferred[i]
        with self.state.meta:
            hs = [later.popitem(last=False)[0] for _ in range(min(batch, len(later)))]
        if not hs:
            return None
        items = self._read_above(i, hs)
        self._lost(i, len(hs) - len(items))
        return items

    def _lost(self, i: int, n: int) -> None:
        """n blocks bound for tier i can no longer reach it (no copy left to send)."""
        if n:
            self.state.count(i, lost=n)
            log.warning("%d blocks bound for tier %s were lost (no copy left to write)", n, self.state.tiers[i].name)

    def _read_above(self, i: int, hashes: Sequence[BlockHash]) -> list[Item]:
        """(hash, object) of each of `hashes` some tier above i holds."""
        found: dict[BlockHash, torch.Tensor] = {}
        for tier in self.state.tiers[:i]:
            todo = [h for h in hashes if h not in found]
            if not todo:
                break
            found.update((h, obj) for h, obj in zip(todo, tier.get_many(todo)) if obj is not None)
        return [(h, found[h]) for h in hashes if h in found]
