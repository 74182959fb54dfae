"""The disk tier's sweep (tiers/disk.py): once, in the background, after
the tier opens, instead of a walk over every file and record before the
first request. It removes data files the index does not know (a crash
between a rename and its index commit, temp files of interrupted puts) and
quarantines records whose file is missing or has the wrong size (damage
from outside; a read meets it first anyway, as a miss). Each decision is taken
again under the tier's commit lock, so a put or delete in flight is never
mistaken for garbage. Its walk over the records also fills the tier's
presence table (tiers/presence.py), which answers lookups once it is whole."""
from __future__ import annotations

import logging
import os
import time
import threading
from pathlib import Path
from typing import Protocol, Sequence

from tiers.disk_index import RECORD, walk
from tiers.disk_io import parse_name, unlink_quiet
from tiers.types import BlockHash

log = logging.getLogger(__name__)


class Swept(Protocol):
    """What the sweep needs of the disk tier."""

    root: Path
    closed: bool
    swept: threading.Event  # set when the sweep ends
    temp_mark: str  # in the names of this tier's own temp files (puts in flight)
    commit_lock: threading.RLock  # held by index writes, renames and unlinks in data/
    def learn(self, after: bytes) -> list[tuple[bytes, bytes]]: ...

    def contains_many(self, hashes: Sequence[BlockHash]) -> list[bool]: ...

    def recheck(self, hashes: Sequence[BlockHash]) -> list[BlockHash]: ...

    def path_of(self, h: BlockHash) -> Path: ...
_BATCH = 4096
_YIELD_S = 0.001  # between batches: a background pass lets requests have the interpreter


def sweep(tier: Swept) -> None:
    """The sweep's thread body; sets `tier.swept` when done (or stopped by close)."""
    try:
        names: list[str] = []
        with os.scandir(tier.root / "data") as files:
            for f in files:
                names.append(f.name)
                if len(names) == _BATCH:
                    _files(tier, names)
                    names = []
        _files(tier, names)
        for chunk in walk(tier.learn):  # fills the presence table too; stops (raises) once the tier closes
            _records(tier, chunk)
    except Exception as e:  # a background worker: a failed sweep leaves garbage, never a crash
        if not tier.closed:
            log.warning("disk tier %s: sweep failed: %s", tier.root, e)
    finally:
        tier.swept.set()


def _files(tier: Swept, names: list[str]) -> None:
    """Remove those of `names` (in data/) that are not indexed blocks, except
    this tier's own temp files."""
    named = [(n, parse_name(n)) for n in names if tier.temp_mark not in n]
    hashes = [h for _, h in named if h is not None]
    with tier.commit_lock:
        if tier.closed:
            raise InterruptedError("closed")
        held = {h for h, ok in zip(hashes, tier.contains_many(hashes)) if ok}
        stray = [n for n, h in named if h not in held]
        for n in stray:
            unlink_quiet(tier.root / "data" / n)
    if stray:
        log.warning("disk tier %s: removed %d files the index did not know", tier.root, len(stray))
    time.sleep(_YIELD_S)


def _records(tier: Swept, chunk: list[tuple[bytes, bytes]]) -> None:
    """Quarantine those records of `chunk` whose file is missing or the wrong size."""
    def bad(h: BlockHash, size: int) -> bool:
        try:
            return os.stat(tier.path_of(h)).st_size != size
        except FileNotFoundError:
            return True

    suspects = [BlockHash(k) for k, v in chunk if bad(BlockHash(k), RECORD.unpack(v)[0])]
    if suspects:  # read back, and quarantined and counted if still damaged (recheck decides under the lock)
        gone = tier.recheck(suspects)
        if gone:
            log.warning("disk tier %s: %d index entries without a valid file quarantined", tier.root, len(gone))
    time.sleep(_YIELD_S)
