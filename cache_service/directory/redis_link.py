"""The Redis directory's connection: one client and its outage state machine.

Redis errors never reach the directory's callers. Each failed request is
counted (``errors``), logged at a bounded rate, drops the client (rebuilt on
the next try: a new slot map, new sockets) and leaves Redis alone for a
backoff that doubles from 0.25 s up to `max_backoff_s`; during it calls fail
at once (``skipped``) without a round trip. The first request that succeeds
again ends the outage (``reconnects``).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException, RedisError
from redis.retry import Retry

from tiers.counters import Counters

# The directory's logger: operators (and tests) filter directory messages by one name.
log = logging.getLogger("cache_service.directory.redis_directory")
FAILURES = (RedisError, RedisClusterException, OSError)
T = TypeVar("T")


class Unavailable(Exception):
    """Internal: Redis is down or being left alone; callers get a default."""


class Link:
    """The Redis client plus the outage state machine: run `fn(client)`,
    or raise Unavailable at once while backing off after a failure.

    `stats` counts requests, errors, skipped and reconnects.
    """

    def __init__(self, make: Callable[[], redis.Redis], stats: Counters, max_backoff_s: float) -> None:
        self._make, self.stats, self.max_backoff_s = make, stats, max_backoff_s
        self._client: redis.Redis | None = None
        self._lock = threading.Lock()
        self._retry_at = 0.0
        self._backoff = 0.0
        self._down = False
        self._next_log = 0.0
        self._quiet = 0

    def ready(self) -> bool:
        """Whether a request may be tried now (no backoff running)."""
        return time.monotonic() >= self._retry_at

    @property
    def up(self) -> bool:
        """False from a failed request until one succeeds again."""
        return not self._down

    def retry_in(self) -> float:
        """Seconds left of the current backoff (0 when none)."""
        return max(0.0, self._retry_at - time.monotonic())

    def call(self, fn: Callable[[redis.Redis], T], what: str) -> T:
        """`fn(client)`; raises Unavailable if Redis fails or is left alone."""
        if not self.ready():
            self.stats.add(skipped=1)
            raise Unavailable
        self.stats.add(requests=1)
        try:
            with self._lock:
                if self._client is None:
                    self._client = self._make()
                client = self._client
            out = fn(client)
        except FAILURES as e:
            self._failed(what, e)
            raise Unavailable from None
        if self._down:
            with self._lock:
                self._down, self._backoff = False, 0.0
            self.stats.add(reconnects=1)
            log.warning("redis directory: reachable again")
        return out

    def call_or(self, fn: Callable[[redis.Redis], T], what: str, default: T) -> T:
        """`fn(client)`, or `default` when Redis cannot be used."""
        try:
            return self.call(fn, what)
        except Unavailable:
            return default

    def _failed(self, what: str, e: Exception) -> None:
        self.stats.add(errors=1)
        with self._lock:
            self._down = True
            self._backoff = min(self.max_backoff_s, max(0.25, 2 * self._backoff))
            self._retry_at = time.monotonic() + self._backoff
            client, self._client = self._client, None  # rebuilt on retry: a new slot map, new sockets
            now = time.monotonic()
            speak = now >= self._next_log
            if speak:
                self._next_log, quiet, self._quiet = now + 10.0, self._quiet, 0
            else:
                self._quiet += 1
        if client is not None:
            _close_quietly(client)
        if speak:
            extra = f" (+{quiet} similar suppressed)" if quiet else ""
            log.warning("redis directory: %s failed (%s); local-only for %.2fs%s", what, e, self._backoff, extra)

    def close(self) -> None:
        """Drop the client; a later call would build a new one."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            _close_quietly(client)


def make_client(url: str, cluster_nodes: Sequence[tuple[str, int]], timeout: float) -> redis.Redis:
    """A client that fails fast: no retries inside redis-py (the Link backs
    off itself), short socket timeouts."""
    kw = dict(socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0))
    if cluster_nodes:
        return RedisCluster(startup_nodes=[ClusterNode(h, int(p)) for h, p in cluster_nodes], **kw)
    return redis.Redis.from_url(url, **kw)


def text(v: bytes | str) -> str:
    """A Redis reply as str (clients may be built with or without decoding)."""
    return v.decode() if isinstance(v, bytes) else v


def _close_quietly(client) -> None:
    try:
        client.close()
    except FAILURES:
        pass
