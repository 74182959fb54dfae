"""The Redis directory's connection: one client and its outage state machine.

Redis errors never reach the directory's callers. Each failed request is
counted (``errors``), logged at a bounded rate, drops the client (rebuilt on
the next try: a new slot map, new sockets) and leaves Redis alone for a
backoff that doubles from 0.25 s up to `max_backoff_s`; during it calls fail
at once (``skipped``) without a round trip. Past the backoff, only a probe
(the directory's own thread: its heartbeat, its queue) tries Redis again,
one at a time; other callers keep failing at once until a probe succeeds, so
no engine request waits on a Redis that hangs. The first request that
succeeds again ends the outage (``reconnects``).

A request Redis answers with an error (OOM at `maxmemory`, WRONGTYPE) is
not an outage: it fails alone (counted, logged, Unavailable to its caller)
and Redis stays up for the rest, reads included; only errors that mean no
answer, or an answer from the wrong server (a replica, a moving slot), do.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (AskError, ClusterDownError, MovedError, ReadOnlyError, RedisClusterException, RedisError,
                              ResponseError, TryAgainError)
from redis.retry import Retry

from tiers.counters import Counters

# The directory's logger: operators (and tests) filter directory messages by one name.
log = logging.getLogger("cache_service.directory.redis_directory")
FAILURES = (RedisError, RedisClusterException, OSError)
_NOT_ANSWERS = (ReadOnlyError, ClusterDownError, TryAgainError, MovedError, AskError)  # wrong server or none


def answered(e: BaseException) -> bool:
    """Whether Redis itself answered this error (up, the request refused)."""
    return isinstance(e, ResponseError) and not isinstance(e, _NOT_ANSWERS)
T = TypeVar("T")


class Unavailable(Exception):
    """Internal: Redis is down or being left alone; callers get a default."""


class Refused(Unavailable):
    """Internal: Redis answered this request with an error (OOM, WRONGTYPE); it is up."""


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
        self._probing = False  # a probe is out (during an outage, one at a time)
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

    def call(self, fn: Callable[[redis.Redis], T], what: str, probe: bool = False) -> T:
        """`fn(client)`; raises Unavailable if Redis fails or is left alone
        (Refused if it answered with an error). During an outage only a
        `probe` tries it (one at a time)."""
        probing = self._claim(probe)
        try:
            out = fn(self._client_for(what))
        except FAILURES as e:
            if answered(e):
                self.refused(what, e)
                raise Refused from None
            self._failed(what, e)
            raise Unavailable from None
        finally:
            if probing:
                self._probing = False
        self._reached()
        return out

    def _reached(self) -> None:
        """Redis answered: an outage, if one was on, is over."""
        if self._down:
            with self._lock:
                self._down, self._backoff = False, 0.0
            self.stats.add(reconnects=1)
            log.warning("redis directory: reachable again")

    def refused(self, what: str, e: Exception) -> None:
        """Redis answered `what` with error `e`: counted and logged (at a bounded rate), Redis up."""
        self.stats.add(errors=1)
        self._reached()
        with self._lock:
            self._log(what, e, "refused by Redis")

    def call_or(self, fn: Callable[[redis.Redis], T], what: str, default: T, probe: bool = False) -> T:
        """`fn(client)`, or `default` when Redis cannot be used."""
        try:
            return self.call(fn, what, probe)
        except Unavailable:
            return default

    def _claim(self, probe: bool) -> bool:
        """Let a request go ahead (True: as the outage's one probe), or count it skipped and raise Unavailable."""
        with self._lock:
            go = self.ready() and (not self._down or (probe and not self._probing))
            probing = go and self._down
            self._probing = self._probing or probing
        self.stats.add(**{"requests" if go else "skipped": 1})
        if not go:
            raise Unavailable
        return probing

    def _client_for(self, what: str) -> redis.Redis:
        """The client, built if need be; Unavailable if a request failed while
        this one waited for the lock (no second build against a hung Redis)."""
        with self._lock:
            if self._client is not None:
                return self._client
            if not self.ready():
                raise Unavailable
            try:
                self._client = self._make()
            except FAILURES as e:
                self._failed_locked(what, e)
                raise Unavailable from None
            return self._client

    def _failed(self, what: str, e: Exception) -> None:
        with self._lock:
            self._failed_locked(what, e)

    def _failed_locked(self, what: str, e: Exception) -> None:
        """A request failed (caller holds the lock): back off, drop the client, log at a bounded rate."""
        self.stats.add(errors=1)
        self._down = True
        self._backoff = min(self.max_backoff_s, max(0.25, 2 * self._backoff))
        self._retry_at = time.monotonic() + self._backoff
        client, self._client = self._client, None  # rebuilt on retry: a new slot map, new sockets
        if client is not None:
            _close_quietly(client)
        self._log(what, e, f"local-only for {self._backoff:.2f}s")

    def _log(self, what: str, e: Exception, then: str) -> None:
        """Warn at a bounded rate (caller holds the lock)."""
        now = time.monotonic()
        if now < self._next_log:
            self._quiet += 1
            return
        self._next_log, quiet, self._quiet = now + 10.0, self._quiet, 0
        extra = f" (+{quiet} similar suppressed)" if quiet else ""
        log.warning("redis directory: %s failed (%s); %s%s", what, e, then, extra)

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
