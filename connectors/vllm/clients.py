"""The vLLM connector's clients: one per cache URL and process, shared by the
scheduler and worker sides that live in it, closed when the last lets go."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from cache_service.store.tiered_store import TieredStore
from connectors.client import CacheClient, connect
from connectors.vllm.lookup import LookupServer, RemoteLookup, is_local, lookup_address
from tiers.types import ConfigError, TierKVError, TierUnavailableError

log = logging.getLogger("vllm.tierkv")

_clients: dict[str, list] = {}  # url -> [client, users, lookup server or None]
_clients_lock = threading.Lock()


class CacheNotOpen(TierUnavailableError):
    """A LateClient's cache is not open yet (logged by the LateClient, every RETRY_S)."""


class LateClient:
    """A client for a cache that could not be opened at startup (a daemon not
    up yet, a directory another process holds): it is opened again in the
    background, at most every RETRY_S, and until it opens each use raises
    CacheNotOpen at once (never waiting on the attempt: the engine's step
    and its save threads call here). The connector's dispatch boundaries
    make that a miss, a failed load (vLLM recomputes) or a dropped save: a
    worker side is never switched off while its scheduler side plans loads for it."""

    RETRY_S = 10.0

    def __init__(self, url: str, why: str, serve: Callable[[CacheClient], LookupServer | None]) -> None:
        """`serve(client)`: the lookup server to start for the client once it opens (it is this one's to close)."""
        self._url, self._why, self._serve = url, why, serve
        self._lock = threading.Lock()
        self._client: CacheClient | None = None
        self._server: LookupServer | None = None
        self._retry_at = time.monotonic() + self.RETRY_S
        self._opening = self._closed = False

    def _real(self) -> CacheClient:
        with self._lock:
            if self._client is not None:
                return self._client
            if not (self._closed or self._opening) and time.monotonic() >= self._retry_at:
                self._opening = True
                threading.Thread(target=self._open, name="tierkv-reopen", daemon=True).start()
            raise CacheNotOpen(self._why)

    def _open(self) -> None:
        try:
            client = connect(self._url)
        except Exception as e:  # a background worker: the next use tries again after RETRY_S
            log.warning("tierkv: %s; tried again in %.0f s", e, self.RETRY_S)
            with self._lock:
                self._why, self._opening, self._retry_at = str(e), False, time.monotonic() + self.RETRY_S
            return
        server = self._serve(client)  # (outside this lock, which every call takes)
        with self._lock:
            self._opening, keep = False, not self._closed
            if keep:
                self._client, self._server = client, server
        if keep:
            log.info("tierkv: %s opened", self._url)
            return
        if server is not None:  # closed meanwhile: what was started for it goes too
            server.close()
        client.close()

    def __getattr__(self, name: str) -> Any:  # every method of the client, once it opens
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._real(), name)

    def close(self) -> None:
        with self._lock:
            client, server, self._client, self._server, self._closed = self._client, self._server, None, None, True
        if server is not None:
            server.close()
        if client is not None:
            client.close()


def acquire(url: str, worker: bool, instance: str = "") -> CacheClient | RemoteLookup | LateClient:
    """One client per URL and process. An embedded store (local://) can be
    opened by one process only: the worker, created first, owns it and serves
    lookups (LookupServer at an address of vLLM instance `instance`); a
    scheduler in the same process shares it, one in another process asks the
    worker (RemoteLookup). A cache that cannot be opened gives a LateClient."""
    with _clients_lock:
        entry = _clients.get(url)
        if entry is None:
            entry = _clients[url] = [None, 0, None]
            entry[0] = _open(url, worker, instance, entry)
        entry[1] += 1
        return entry[0]


def _open(url: str, worker: bool, instance: str, entry: list) -> CacheClient | RemoteLookup | LateClient:
    try:
        client = connect(url)
    except TierUnavailableError as e:
        if not worker and is_local(url):
            log.info("tierkv: %s; the scheduler looks blocks up through the worker that owns it", e)
            return RemoteLookup(lookup_address(url, instance))
        log.warning("tierkv: %s; until it opens (tried every %.0f s) lookups miss, loads fail (vLLM "
                    "recomputes) and saves are dropped", e, LateClient.RETRY_S)
        return LateClient(url, str(e), lambda c: _served(c, url, worker, instance))
    except TierKVError as e:  # malformed URL: a configuration error, fail startup
        raise ConfigError(f"kv_connector_extra_config.url: {e}") from e
    entry[2] = _served(client, url, worker, instance)
    return client


def _served(client: CacheClient, url: str, worker: bool, instance: str) -> LookupServer | None:
    """A worker that opened an embedded store serves its scheduler's lookups: the server, or None."""
    if worker and is_local(url) and isinstance(client, TieredStore):
        return _serve_lookups(client, url, instance)
    return None


def _serve_lookups(store: TieredStore, url: str, instance: str) -> LookupServer | None:
    try:
        return LookupServer(store, lookup_address(url, instance))
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
