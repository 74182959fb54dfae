"""Eviction policies behind one interface, built by name from config.

The registry maps a policy name to ``"module:Class"``; the module is
imported the first time that policy is asked for, so adding a policy is one
line here and one file beside this one.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from cache_service.store.eviction.base import EvictionPolicy, PinnedFn
from tiers.registry import resolve
from tiers.types import ConfigError

if TYPE_CHECKING:
    from tiers.base import Tier

_REGISTRY: dict[str, str] = {
    "lru": "cache_service.store.eviction.lru:LRUPolicy",
    "lfu": "cache_service.store.eviction.lfu:LFUPolicy",
    "s3fifo": "cache_service.store.eviction.s3fifo:S3FIFOPolicy",
    "arc": "cache_service.store.eviction.arc:ARCPolicy",
    "sampled": "cache_service.store.eviction.sampled:SampledLRUPolicy",
}

TIER_POLICIES: tuple[str, ...] = ("sampled",)
"""Policies that read a tier's own records (for tiers that `keeps_recency`)."""
POLICIES: tuple[str, ...] = tuple(n for n in _REGISTRY if n not in TIER_POLICIES)
"""Self-contained policies (any tier), in registry order."""

_loaded: dict[str, type[EvictionPolicy]] = {}


def policy_class(name: str, *, key: str = "eviction_policy") -> type[EvictionPolicy]:
    """The policy class registered as ``name`` (imported on first use).

    ``key`` is the config key the name came from; it is named in the
    ConfigError raised for an unknown name.
    """
    cls = _loaded.get(name)
    if cls is not None:
        return cls
    target = _REGISTRY.get(name) if isinstance(name, str) else None
    if target is None:
        raise ConfigError(f"{key}={name!r} is not a known eviction policy; valid choices: {', '.join(_REGISTRY)}")
    cls = resolve(target)
    assert issubclass(cls, EvictionPolicy) and cls.name == name, f"registry entry {name!r} -> {target} is wrong"
    _loaded[name] = cls
    return cls


def make_policy(name: str, capacity_blocks: int, *, key: str = "eviction_policy",
                source: "Tier | None" = None) -> EvictionPolicy:
    """A new ``name`` policy for a tier holding ``capacity_blocks`` blocks;
    ``source`` is that tier, for a policy that reads its recency there
    ("sampled": the tier must keep access times).

    Raises ConfigError naming ``key`` and the valid choices for an unknown
    name, for a capacity that is not a positive int, and for a "sampled"
    policy over a tier that keeps no access times.
    """
    cls = policy_class(name, key=key)
    return cls(capacity_blocks) if cls.rebuilt_from_keys else cls(capacity_blocks, source=source)


__all__ = ["EvictionPolicy", "PinnedFn", "POLICIES", "TIER_POLICIES", "make_policy", "policy_class"]
