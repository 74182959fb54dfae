"""Shared scaffolding for store tests: a small namespace and key-derived payloads."""
from __future__ import annotations

import threading
import time

import torch

from cache_service.config import load_config
from cache_service.factory import open_store
from cache_service.blocks.keys import Namespace, prefix_hashes
from cache_service.blocks.objects import object_size
from cache_service.store.tiered_store import TieredStore
from tiers.disk import DiskTier

NS = Namespace("test-model", "bfloat16", num_layers=2, kv_heads=2, head_dim=16, block_tokens=4)
OBJ = object_size(NS)


def hashes(n: int, start: int = 0) -> list:
    """n chained block hashes of a deterministic prompt."""
    return prefix_hashes(NS, range(start, start + 4 * n))


def payload_for(h: bytes) -> torch.Tensor:
    """Content derived from the key, so any returned block can be checked."""
    g = torch.Generator().manual_seed(int.from_bytes(h[:8], "little") & (2**63 - 1))
    return torch.randn(NS.block_shape, generator=g).to(torch.bfloat16)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


def make_store(root, cpu_blocks: int = 16, disk_blocks: int | None = 4096, shared: bool = False,
               **store) -> TieredStore:
    tiers = {"cpu": {"capacity": cpu_blocks * OBJ, "slot_bytes": OBJ, "shared": "yes" if shared else "no"}}
    if disk_blocks:
        tiers["disk"] = {"path": str(root), "capacity": disk_blocks * OBJ, "fsync": True}
    return open_store(load_config(env={}, overrides={"tiers": tiers, "store": store}))


def write_flushed(store, hs) -> None:
    """Store payload_for(h) for each hash and wait until every tier below has it."""
    store.store(NS, hs, [payload_for(h) for h in hs])
    assert store.flush(120)


def all_same(got, hs) -> bool:
    """Every loaded payload present and equal to payload_for(its hash)."""
    return all(g is not None and same(g, payload_for(h)) for g, h in zip(got, hs))


class FlakyDisk(DiskTier):
    """A real disk tier that refuses every write while `down` (as S3 does
    during an outage: put_many returns False and available() says why), and
    then `refuse` more writes while saying it is available (as a gateway
    does while it comes back: errors that do not look like an outage)."""

    down = False
    refuse = 0
    delay = 0.0  # seconds per put_many once back (a slow gateway)
    writing: threading.Event

    def available(self) -> bool:
        return not self.down

    def put_many(self, hashes, objs):
        if not self.down and self.delay:
            self.writing.set()
            time.sleep(self.delay)
        if self.down:
            return [False] * len(hashes)
        if self.refuse:
            self.refuse -= 1
            return [False] * len(hashes)
        return super().put_many(hashes, objs)


def until(check, limit_s: float = 20.0) -> bool:
    deadline = time.monotonic() + limit_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
