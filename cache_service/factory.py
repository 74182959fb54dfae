"""Build a TieredStore from a typed Config (lazy tier registry, no ladder)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from cache_service.config import TIER_ORDER, Config, CpuConfig, DiskConfig, HbmConfig, TierConfig
from cache_service.config import S3Config
from cache_service.eviction import make_policy
from cache_service.store import TieredStore
from tiers.base import Tier


@dataclass(frozen=True, slots=True)
class _Entry:
    target: str  # "module:Class", imported on first use
    kwargs: Callable[[Any], dict[str, Any]]


def _hbm_kwargs(c: HbmConfig) -> dict[str, Any]:
    kw: dict[str, Any] = dict(capacity_bytes=c.capacity, slot_bytes=c.slot_bytes or None)
    return kw | ({"device": c.device} if c.device else {})


def _cpu_kwargs(c: CpuConfig) -> dict[str, Any]:
    pin = {"auto": None, "yes": True, "no": False}[c.pin]
    return dict(capacity_bytes=c.capacity, slot_bytes=c.slot_bytes or None, pin=pin)


def _disk_kwargs(c: DiskConfig) -> dict[str, Any]:
    return dict(root=c.path, capacity_bytes=c.capacity, fsync=c.fsync)


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
    module, cls = entry.target.split(":")
    return getattr(importlib.import_module(module), cls)(**entry.kwargs(cfg))


def open_store(cfg: Config) -> TieredStore:
    """The store described by `cfg`, tiers in hierarchy order."""
    kinds = [k for k in TIER_ORDER if k in TIER_REGISTRY and getattr(cfg.tiers, k, None) is not None]
    if "hbm" in kinds and not cfg.tiers.hbm.device and not torch.cuda.is_available():
        kinds.remove("hbm")  # no device: the host tier is the top
    sections = [getattr(cfg.tiers, k) for k in kinds]
    tiers = [make_tier(k, c) for k, c in zip(kinds, sections)]
    policies = [make_policy(c.policy, _capacity_blocks(t)) for t, c in zip(tiers, sections)]
    return TieredStore(tiers, policies, [c.write for c in sections], cfg.store)


def _capacity_blocks(tier: Tier) -> int:
    # a policy's ghost lists are sized in blocks; assume >= 64 KiB blocks
    return max(16, tier.capacity_bytes // (64 * 1024))
