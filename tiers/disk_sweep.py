"""The disk tier's sweep (tiers/disk.py): once, in the background, after
the tier opens, instead of a walk over every record before the first
request. Its walk over the records fills the tier's presence table
(tiers/presence.py), which answers lookups once it is whole, and marks the
slots in use, so that at its end the slots deletes left free below the
marks are handed out again (tiers/disk_space.py). It quarantines records
whose slot lies past the end of its segment file (damage from outside; a
read meets it first anyway, as a miss), and removes a one-file-per-block
layout that the open set aside. Each decision is taken again under the
tier's commit lock, so a put or delete in flight is never mistaken for
damage."""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from tiers.disk_index import RECORD, walk
from tiers.disk_io import remove_old_layouts
from tiers.disk_slots import Segments
from tiers.disk_space import FreeSlots
from tiers.types import BlockHash

log = logging.getLogger(__name__)


class Swept(Protocol):
    """What the sweep needs of the disk tier."""

    root: Path
    closed: bool
    swept: threading.Event  # set when the sweep ends
    segments: Segments
    space: FreeSlots
    recovering: bool  # the index was dirty at open (tiers/disk_fresh.py)
    def learn(self, after: bytes) -> list[tuple[bytes, bytes]]: ...

    def recheck(self, hashes: Sequence[BlockHash]) -> list[BlockHash]: ...

    def recover(self, holes: dict[int, np.ndarray]) -> int: ...

    def reclaim(self) -> None: ...
_YIELD_S = 0.001  # between batches: a background pass lets requests have the interpreter


RECOVER_RETRY_S = 30.0  # a recovery whose index writes were refused (a full disk) is tried again this often


def sweep(tier: Swept) -> None:
    """The sweep's thread body; sets `tier.swept` when done (or stopped by close),
    then, while a recovery the index refused stays to do, tries it again."""
    try:
        for chunk in walk(tier.learn):  # stops (raises) once the tier closes
            _records(tier, chunk)
        if tier.recovering:
            tier.recover(tier.space.holes())
        freed = tier.space.walked()
        if freed:
            log.info("disk tier %s: %d free slots found below the marks", tier.root, freed)
        tier.reclaim()
        remove_old_layouts(tier.root)
    except Exception as e:  # a background worker: a failed sweep leaves free slots unused, never a crash
        if not tier.closed:
            log.warning("disk tier %s: sweep failed: %s", tier.root, e)
    finally:
        tier.swept.set()
    _recover_later(tier)


def _recover_later(tier: Swept) -> None:
    next_try = time.monotonic() + RECOVER_RETRY_S
    while tier.recovering and not tier.closed:
        time.sleep(0.1)  # close() joins this thread: it notices within a tenth of a second
        if time.monotonic() >= next_try:
            next_try = time.monotonic() + RECOVER_RETRY_S
            try:
                tier.recover(tier.space.holes())
            except Exception as e:  # a background worker: the next try may succeed
                if not tier.closed:
                    log.warning("disk tier %s: recovery failed: %s", tier.root, e)


def _records(tier: Swept, chunk: list[tuple[bytes, bytes]]) -> None:
    """Quarantine those records of `chunk` whose slot lies past its file's end
    or whose header does not name the block (erased, overwritten)."""
    ends = tier.segments.ends()
    suspects = []
    for k, v in chunk:
        size, csum, s, _ = RECORD.unpack(v)
        if not tier.segments.headed(BlockHash(k), size, csum, s, ends):
            suspects.append(BlockHash(k))
    if suspects:  # read back, and quarantined and counted if still damaged (recheck decides under the lock)
        gone = tier.recheck(suspects)
        if gone:
            log.warning("disk tier %s: %d index entries without a whole slot: quarantined, or gone meanwhile", tier.root, len(gone))
    time.sleep(_YIELD_S)
