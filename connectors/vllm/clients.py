"""The vLLM connector's clients: one per cache URL and process, shared by the
scheduler and worker sides that live in it, closed when the last lets go."""
from __future__ import annotations

import logging
import threading

from cache_service.store.tiered_store import TieredStore
from connectors.client import CacheClient, connect
from connectors.vllm.lookup import LookupServer, RemoteLookup, is_local, lookup_address
from tiers.types import ConfigError, TierKVError, TierUnavailableError

log = logging.getLogger("vllm.tierkv")

_clients: dict[str, list] = {}  # url -> [client, users, lookup server or None]
_clients_lock = threading.Lock()


def acquire(url: str, worker: bool) -> CacheClient | RemoteLookup | None:
    """One client per URL and process. An embedded store (local://) can be
    opened by one process only: the worker, created first, owns it and serves
    lookups (LookupServer); a scheduler in the same process shares it, one in
    another process asks the worker (RemoteLookup)."""
    with _clients_lock:
        entry = _clients.get(url)
        if entry is None:
            entry = _clients[url] = [_open(url, worker), 0, None]
            if worker and is_local(url) and isinstance(entry[0], TieredStore):
                entry[2] = _serve_lookups(entry[0], url)
        entry[1] += 1
        return entry[0]


def _open(url: str, worker: bool) -> CacheClient | RemoteLookup | None:
    try:
        return connect(url)
    except TierUnavailableError as e:
        if not worker and is_local(url):
            log.info("tierkv: %s; the scheduler looks blocks up through the worker that owns it", e)
            return RemoteLookup(lookup_address(url))
        log.warning("tierkv: %s; the connector is disabled (vLLM runs without the cache)", e)
        return None
    except TierKVError as e:  # malformed URL: a configuration error, fail startup
        raise ConfigError(f"kv_connector_extra_config.url: {e}") from e


def _serve_lookups(store: TieredStore, url: str) -> LookupServer | None:
    try:
        return LookupServer(store, lookup_address(url))
    except OSError as e:  # another process serves this store: ours is not the owner
        log.warning("tierkv: cannot serve lookups for %s (%s)", url, e)
        return None


def release(url: str) -> None:
    with _clients_lock:
        entry = _clients.get(url)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _clients[url]
    _close(entry)


def _close(entry: list) -> None:
    client, _, server = entry
    if server is not None:
        server.close()
    if client is not None:
        client.close()  # flushes background writes


def close_all() -> None:
    """Close every client still open (at exit)."""
    with _clients_lock:
        entries = list(_clients.values())
        _clients.clear()
    for entry in entries:
        _close(entry)
