"""tierkv's cache service: the store, its sessions, and the daemon that serves it.

The front door. Every name below is imported on first use, so
``import cache_service`` costs nothing and imports no subpackage:

    from cache_service import load_config, open_store, Namespace, prefix_hashes

    cfg = load_config("tierkv.toml")          # TOML + TIERKV_* env + overrides
    with open_store(cfg) as store:             # CPU over disk (over S3), as configured
        hs = prefix_hashes(ns, token_ids)      # one BlockHash per full block
        store.store(ns, hs, payloads)          # [layers, 2, block_tokens, kv_heads, head_dim]
        hits = store.lookup(hs)                # how many leading blocks are held
        payloads = store.load(ns, hs[:hits])

Subpackages by role: ``blocks`` (keys, object format), ``store`` (the tiered
store, placement, writers, eviction), ``sessions`` (manifests),
``directory`` (the Redis directory across nodes), ``protocol`` (what a
client and the daemon share), ``server`` (the daemon). docs/architecture.md
follows a load through them.
"""
from __future__ import annotations

from tiers.registry import lazy_exports

_EXPORTS = {
    "Config": "cache_service.config:Config",
    "load_config": "cache_service.config:load_config",
    "open_store": "cache_service.factory:open_store",
    "open_directory": "cache_service.factory:open_directory",
    "open_sessions": "cache_service.factory:open_sessions",
    "TieredStore": "cache_service.store.tiered_store:TieredStore",
    "Namespace": "cache_service.blocks.keys:Namespace",
    "prefix_hashes": "cache_service.blocks.keys:prefix_hashes",
    "SessionManager": "cache_service.sessions.manifests:SessionManager",
    "Daemon": "cache_service.server.daemon:Daemon",
    "serve": "cache_service.server.daemon:serve",
    "BlockHash": "tiers.types:BlockHash",
    "TierKVError": "tiers.types:TierKVError",
    "ConfigError": "tiers.types:ConfigError",
    "CorruptBlockError": "tiers.types:CorruptBlockError",
    "CapacityError": "tiers.types:CapacityError",
    "TierUnavailableError": "tiers.types:TierUnavailableError",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports("cache_service", _EXPORTS)
