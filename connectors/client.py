"""The engine-side view of the cache service: `connect(url)`.

URL schemes (the same everywhere: CLI flag, vLLM extra config):

- ``local:///path/to/dir`` - an embedded `TieredStore` in this process (CPU
  tier over a disk tier rooted at the path); ``local://`` uses the default
  directory (``$TIERKV_CACHE_DIR/store``). Query parameters override tier
  settings: ``local:///d?cpu=2GiB&disk=20GiB&policy=s3fifo``.
- ``grpc://host:port`` - the standalone daemon (`tierkv serve`).
- ``none`` - no cache.

Everything else in `connectors/` talks to a `CacheClient`, so an engine does
not care whether the store is embedded or remote.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Protocol, Sequence
from urllib.parse import parse_qs, urlsplit

import torch

from cache_service.config import Config, default_cache_dir, load_config
from cache_service.factory import open_sessions, open_store
from cache_service.blocks.keys import Namespace
from cache_service.sessions.manifests import Manifests
from tiers.types import BlockHash, ConfigError, TierKVError, TierUnavailableError

log = logging.getLogger("tierkv.client")
_QUERY_KEYS = {"cpu": ("cpu", "capacity"), "disk": ("disk", "capacity"), "policy": (None, "policy"),
               "fsync": ("disk", "fsync")}


class CacheClient(Protocol):
    """What a connector needs from the cache service (embedded or remote)."""

    def lookup(self, hashes: Sequence[BlockHash]) -> int: ...

    def load(self, ns: Namespace, hashes: Sequence[BlockHash]) -> list[torch.Tensor | None]: ...

    def store(self, ns: Namespace, hashes: Sequence[BlockHash],
              payloads: Sequence[torch.Tensor] | torch.Tensor) -> int: ...  # or one tensor, a block per row

    def stats(self) -> dict[str, dict[str, int]]: ...

    def close(self) -> None: ...


def local_config(url: str, config_file: str | os.PathLike | None = None) -> Config:
    """Config of an embedded store for a ``local://`` URL: the TOML
    `config_file` (the file `tierkv serve --config` reads: tiers, S3,
    directory) and ``TIERKV_*`` variables, then the URL's path and parameters
    over them. Without a file: a 20 GiB disk tier at the URL's path (default:
    the cache dir)."""
    parts = urlsplit(url)
    if parts.netloc:  # local://relative/path would drop "relative": refused, not a surprise location
        raise ConfigError(f"cache URL {url!r}: expected local:///absolute/path (three slashes) or local://")
    tiers: dict[str, dict] = {}
    if parts.path or config_file is None:
        tiers["disk"] = {"path": parts.path or str(default_cache_dir() / "store")}
    if config_file is None:
        tiers["disk"]["capacity"] = "20GiB"
    for key, values in parse_qs(parts.query, keep_blank_values=True).items():
        if key not in _QUERY_KEYS:
            raise ConfigError(f"cache URL {url!r}: unknown parameter {key!r} (known: {', '.join(_QUERY_KEYS)})")
        if not values[-1]:
            raise ConfigError(f"cache URL {url!r}: parameter {key!r} has no value")
        tier, field = _QUERY_KEYS[key]
        for t in ([tier] if tier else ["cpu", "disk"]):
            tiers.setdefault(t, {})[field] = values[-1]
    return load_config(config_file, overrides={"tiers": tiers})


def session_manifests(url: str, config_file: str | os.PathLike | None, client: object = None) -> Manifests:
    """Where a cache's session manifests live: shared (Redis + S3) when the
    config has a ``[directory]``, else files next to the local store."""
    cfg = local_config(url, config_file) if url.startswith("local://") else load_config(config_file)
    root = Path(cfg.tiers.disk.path) if url.startswith("local://") and cfg.tiers.disk is not None \
        else default_cache_dir() / "store"
    return open_sessions(cfg, root, client)


def connect(url: str, config_file: str | os.PathLike | None = None) -> CacheClient | None:
    """A client for `url`, or None for ``none``; an embedded (``local://``)
    store is configured by `config_file` under the URL (`local_config`).
    Raises TierKVError for a malformed URL and TierUnavailableError when the
    service cannot be used."""
    if url in ("none", ""):
        return None
    scheme = urlsplit(url).scheme if "://" in url else None
    if scheme == "local":
        try:
            return open_store(local_config(url, config_file))
        except OSError as e:
            raise TierUnavailableError(f"cannot open local cache at {urlsplit(url).path or 'default dir'}: {e}") from e
    if scheme == "grpc":
        from connectors.grpc.client import GrpcClient  # lazy: grpc only when a daemon is used

        return GrpcClient(url)  # (which checks host and port before it connects)
    raise TierKVError(f"cache URL {url!r}: expected local:///path/to/dir, local://, grpc://host:port or none")
