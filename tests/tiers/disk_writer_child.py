"""Child process for the DiskTier crash and reopen tests.

    python disk_writer_child.py write ROOT CAPACITY SEED
        open the tier, print "ready", then put (and now and then delete)
        blocks until killed or done
    python disk_writer_child.py check ROOT CAPACITY
        open the tier, read every block, print "<n> ok" if each is
        byte-exact, exit 1 otherwise

Block content is a pure function of the block hash, so any process can tell
whether a block it reads back is exactly what was written.
"""
from __future__ import annotations

import random
import sys

import numpy as np
import torch
import xxhash

from tiers.disk import DiskTier
from tiers.types import BlockHash


def key_for(seed: int, i: int) -> BlockHash:
    """The i-th block hash of a writer run."""
    return BlockHash(xxhash.xxh3_128_digest(f"writer/{seed}/{i}".encode()))


def block_for(h: BlockHash) -> torch.Tensor:
    """The object stored under `h`: 4-68 KiB of bytes seeded by the hash."""
    size = 4096 + (h[0] % 64) * 1024
    rng = np.random.default_rng(int.from_bytes(h[:8], "little"))
    return torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8))


def write(root: str, capacity: int, seed: int, max_puts: int = 100_000) -> None:
    rng = random.Random(seed)
    tier = DiskTier(root, capacity, fsync=True)
    print("ready", flush=True)
    i = 0
    while i < max_puts:
        batch = [key_for(seed, i + j) for j in range(rng.randint(1, 4))]
        i += len(batch)
        if not all(tier.put_many(batch, [block_for(h) for h in batch])):
            tier.delete_many(tier.keys()[:4])  # full: evict the least recently used
        if rng.random() < 0.2:
            held = tier.keys()
            tier.delete_many(rng.sample(held, min(2, len(held))))
    tier.close()


def check(root: str, capacity: int) -> int:
    tier = DiskTier(root, capacity)
    keys = tier.keys()
    got = tier.get_many(keys)
    bad = [h.hex() for h, obj in zip(keys, got) if obj is None or not torch.equal(obj, block_for(h))]
    tier.close()
    if bad:
        print(f"{len(bad)} bad: {bad[:4]}")
        return 1
    print(f"{len(keys)} ok")
    return 0


if __name__ == "__main__":
    cmd, root, cap = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if cmd == "write":
        write(root, cap, int(sys.argv[4]))
    else:
        sys.exit(check(root, cap))
