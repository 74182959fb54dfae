"""Build a TieredStore from a typed Config (lazy tier registry, no ladder)."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
import xxhash

from cache_service.config import TIER_ORDER, Config, CpuConfig, DiskConfig, HbmConfig, TierConfig
from cache_service.config import S3Config
from cache_service.blocks.objects import intact
from cache_service.store.eviction import make_policy
from cache_service.sessions.manifests import Manifests, SessionStore
from cache_service.sessions.shared import PendingManifests, S3Manifests, SharedSessionStore
from cache_service.store.journal import UploadJournal
from cache_service.store.tiered_store import TieredStore
from tiers.base import Tier
from tiers.cache_root import default_cache_dir
from tiers.registry import resolve

if TYPE_CHECKING:
    from cache_service.directory.redis_directory import RedisDirectory


@dataclass(frozen=True, slots=True)
class _Entry:
    target: str  # "module:Class", imported on first use
    kwargs: Callable[[Any], dict[str, Any]]


def _hbm_kwargs(c: HbmConfig) -> dict[str, Any]:
    kw: dict[str, Any] = dict(capacity_bytes=c.capacity, slot_bytes=c.slot_bytes or None)
    return kw | ({"device": c.device} if c.device else {})


def _cpu_kwargs(c: CpuConfig) -> dict[str, Any]:
    pin = {"auto": None, "yes": True, "no": False}[c.pin]
    return dict(capacity_bytes=c.capacity, slot_bytes=c.slot_bytes or None, pin=pin, prefault=c.prefault,
                shared=c.shared == "yes")


def _disk_kwargs(c: DiskConfig) -> dict[str, Any]:
    return dict(root=c.path, capacity_bytes=c.capacity, fsync=c.fsync, check=intact)


def _s3_kwargs(c: S3Config) -> dict[str, Any]:
    return dict(bucket=c.bucket, capacity_bytes=c.capacity, prefix=c.prefix, endpoint_url=c.endpoint or None,
                region=c.region, access_key=c.access_key or None, secret_key=c.secret_key or None,
                addressing_style=c.addressing_style, max_concurrency=c.max_concurrency,
                multipart_threshold=c.multipart_threshold, connect_timeout=c.connect_timeout,
                read_timeout=c.read_timeout, retries=c.retries)


TIER_REGISTRY: dict[str, _Entry] = {
    "hbm": _Entry("tiers.hbm:HbmTier", _hbm_kwargs),
    "cpu": _Entry("tiers.cpu:CpuTier", _cpu_kwargs),
    "disk": _Entry("tiers.disk:DiskTier", _disk_kwargs),
    "s3": _Entry("tiers.s3:S3Tier", _s3_kwargs),
}


def make_tier(kind: str, cfg: TierConfig) -> Tier:
    """Instantiate one tier from its config section."""
    entry = TIER_REGISTRY[kind]
    return resolve(entry.target)(**entry.kwargs(cfg))


def open_store(cfg: Config) -> TieredStore:
    """The store described by `cfg`, tiers in hierarchy order."""
    kinds = [k for k in TIER_ORDER if k in TIER_REGISTRY and getattr(cfg.tiers, k, None) is not None]
    if "hbm" in kinds and not cfg.tiers.hbm.device and not torch.cuda.is_available():
        kinds.remove("hbm")  # no device: the host tier is the top
    sections = [getattr(cfg.tiers, k) for k in kinds]
    tiers = [make_tier(k, c) for k, c in zip(kinds, sections)]
    policies = [make_policy(c.policy, _capacity_blocks(t), key=f"tiers.{k}.policy", source=t)
                for k, t, c in zip(kinds, tiers, sections)]
    directory = open_directory(cfg) if cfg.directory is not None else None
    return TieredStore(tiers, policies, [c.write for c in sections], cfg.store, directory=directory,
                       journals=open_journals(cfg))


def open_journals(cfg: Config) -> dict[str, UploadJournal]:
    """The S3 tier's upload journal, if it has one: beside the disk tier's
    index (that tier's lock covers it), else under the cache root, one per
    bucket and prefix."""
    s3, disk = cfg.tiers.s3, cfg.tiers.disk
    if s3 is None or not s3.journal_bytes:
        return {}
    if s3.journal_path:
        path = Path(s3.journal_path)
    elif disk is not None:
        path = Path(disk.path) / "journal.lmdb"
    else:
        where = xxhash.xxh3_64_hexdigest(f"{s3.endpoint}|{s3.bucket}|{s3.prefix}".encode())
        path = default_cache_dir() / "journals" / where
    return {"s3": UploadJournal(path, s3.journal_bytes, fsync=disk.fsync if disk is not None else True)}


def open_directory(cfg: Config, node: bool = True) -> "RedisDirectory":
    """The Redis directory of `cfg` (which must configure one). `node`: this
    process holds blocks (registers, heartbeats); False: a reader."""
    from cache_service.directory.redis_directory import RedisDirectory  # lazy: redis only when configured

    d, s3, disk = cfg.directory, cfg.tiers.s3, cfg.tiers.disk
    assert d is not None, "no [directory] configured"
    # Default prefix: the bucket, so "in S3" in the directory means this deployment's S3.
    prefix = d.prefix or (f"{s3.bucket}/{s3.prefix}" if s3 is not None else "tierkv")
    node_id = d.node_id or socket.gethostname() + (
        f"-{xxhash.xxh3_64_hexdigest(os.path.abspath(disk.path).encode())[:8]}" if disk is not None else "")
    return RedisDirectory(url=d.url, cluster_nodes=d.cluster_nodes(), node_id=node_id if node else None,
                          endpoint=d.endpoint, prefix=prefix, heartbeat_ttl_s=d.heartbeat_ttl_s,
                          block_ttl_s=d.block_ttl_s, socket_timeout_s=d.socket_timeout_s,
                          max_backoff_s=d.max_backoff_s)


def open_sessions(cfg: Config, root: str | os.PathLike, store: Any = None) -> Manifests:
    """Session manifests for `cfg`: local files under `root` without a
    directory; with one, shared through Redis over a durable copy in S3 (or
    under `root` when there is no S3 tier). Reuses `store`'s directory when it
    has one."""
    if cfg.directory is None:
        return SessionStore(root)
    durable: Manifests = SessionStore(root)
    if cfg.tiers.s3 is not None:  # S3 is the truth; what it refuses waits in local files (PendingManifests)
        durable = PendingManifests(S3Manifests(cfg.tiers.s3), SessionStore(Path(root) / "pending-manifests"))
    directory, shared = getattr(store, "directory", None), cfg.tiers.s3 is not None
    if directory is not None:
        return SharedSessionStore(directory, durable, shared_durable=shared)
    return SharedSessionStore(open_directory(cfg, node=False), durable, owns_directory=True, shared_durable=shared)


def _capacity_blocks(tier: Tier) -> int:
    # a policy's ghost lists are sized in blocks; assume >= 64 KiB blocks
    return max(16, tier.capacity_bytes // (64 * 1024))
