"""Reach the disk tier's objects behind its back, as damage would
(tiers/disk.py keeps them in slots of segment files, tiers/disk_slots.py).

A place is (segment file, offset of the object's bytes, object size), from
`DiskTier.location_of` while the tier is open, or `place_of` from its index
read as a bystander (another process may own the tier).
"""
from __future__ import annotations

from pathlib import Path

import lmdb

from tiers.disk_index import RECORD
from tiers.disk_geometry import HEAD, MAGIC, parse, per_file, place

Place = tuple[Path, int, int]


def place_of(root: Path, h: bytes) -> Place | None:
    """Where block `h`'s object lies in the disk tier at `root`, read from its index."""
    env = lmdb.open(str(root / "index.lmdb"), readonly=True, lock=False, subdir=True)
    try:
        with env.begin() as txn:
            rec = txn.get(h)
    finally:
        env.close()
    if rec is None:
        return None
    size, _, s, _ = RECORD.unpack(rec)
    key, off = place(size, s)
    return root / "segments" / f"{key[0]}-{key[1]}", off + HEAD.size, size


def read_at(p: Place) -> bytes:
    path, off, size = p
    with open(path, "rb") as f:
        f.seek(off)
        return f.read(size)


def write_at(p: Place, data: bytes | None) -> None:
    """Replace the object's bytes with `data`: cut to the object's size, or
    zero-filled after a shorter one; None erases the slot, header and all."""
    path, off, size = p
    if data is None:
        off, data, size = off - HEAD.size, b"", size + HEAD.size
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(data[:size].ljust(size, b"\0"))


def headed_slots(root: Path) -> int:
    """Slots of the segment files under `root` that begin with a block header."""
    n = 0
    for f in (root / "segments").iterdir():
        key = parse(f.name)
        if key is None:
            continue
        with open(f, "rb") as fh:
            for i in range(min(per_file(key[0]), f.stat().st_size // key[0])):
                fh.seek(i * key[0])
                n += fh.read(len(MAGIC)) == MAGIC
    return n
