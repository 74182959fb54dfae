"""Redis directory: the cross-node index of one tierkv deployment.

What it holds (``P`` = ``tkv:<prefix>``; braces are Redis Cluster hash tags)::

    {P:nodes}:n:<node>       node record (JSON: endpoint, host, pid, started), EX heartbeat_ttl
    {P:nodes}:all            SET of registered node ids (pruned when a record expires)
    {P:nodes}:epoch          a random token written once per Redis lifetime
    P:b:<hash hex>           SET of a block's locations: "s3" and/or node ids (their disk), EX block_ttl
    {P:t:<tenant>}:s:<id>    session manifest (JSON bytes)
    {P:t:<tenant>}:index     SET of the tenant's session ids
    {P:t:<tenant>}:pins      ZSET session id -> pinned until (epoch seconds)

Node keys share a slot (one MGET reads every record); a tenant's keys share a
slot (saving a session is one MULTI/EXEC); block keys spread over the cluster.

A hint, never the truth: S3 and each node's tiers are. A stale or missing
entry costs a miss the engine recomputes. Entries heal by themselves: block
keys expire, node records expire without heartbeats, and a node that
(re)registers (first start, its record expired, Redis restarted empty)
re-announces what it holds through the `on_register` callbacks, paced
(announcements.py); told whether Redis lost its data (the epoch token
changed), every node re-announces the S3 blocks it knows too, and so it does
after updates were dropped (the queue bound, below) and every half block TTL
(entries of blocks still held must not lapse).

Availability. Redis errors never reach callers (redis_link.py: counted,
logged at a bounded rate, Redis left alone for a doubling backoff up to
`max_backoff_s`); meanwhile calls return at once (``skipped``): lookups find
nothing, manifests read None, block updates stay queued (bounded; the oldest
are dropped and counted). An update Redis refuses (OOM) is counted, not
retried. A background thread heartbeats, drains the update queue and probes
Redis when it is down. On the hot path `publish` and
`unpublish` only append to that queue; `locate_many` is one pipeline for the
whole batch, and a store asks only about blocks its own tiers miss.
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from tiers.counters import Counters
from cache_service.directory.announcements import Announcements
from cache_service.directory.redis_link import Link, Refused, Unavailable, answered, make_client, text
from cache_service.directory.redis_sessions import SessionKeys
from tiers.types import BlockHash, ConfigError

log = logging.getLogger(__name__)
S3 = "s3"  # the location of a block in the deployment's bucket
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")  # fullmatched; no braces: they would move hash slots
_BATCH = 512  # block updates per pipeline


@dataclass(slots=True)
class DirectoryStats(Counters):
    """Counters of one directory client."""

    requests: int = 0  # round trips attempted (a pipeline is one)
    locates: int = 0  # locate_many round trips (one per store lookup that missed locally)
    errors: int = 0  # requests that failed
    skipped: int = 0  # calls answered without Redis during a backoff
    published: int = 0
    unpublished: int = 0
    dropped: int = 0  # queued updates lost to the queue bound
    refused: int = 0  # update commands Redis answered with an error (OOM at maxmemory, WRONGTYPE): not retried
    reconnects: int = 0
    registrations: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)


class RedisDirectory(SessionKeys):
    """Directory client of one node (`node_id`) or of a reader (`node_id` None:
    no registration, no heartbeat). Give `url` (``redis://host:port/db``) or
    `cluster_nodes` (startup ``(host, port)`` pairs of a Redis Cluster)."""

    def __init__(self, *, url: str = "", cluster_nodes: Sequence[tuple[str, int]] = (), node_id: str | None,
                 endpoint: str = "", prefix: str = "tierkv", heartbeat_ttl_s: float = 15.0,
                 block_ttl_s: float = 7 * 86400, socket_timeout_s: float = 0.5, max_backoff_s: float = 2.0,
                 queue_limit: int = 1 << 20) -> None:
        if bool(url) == bool(cluster_nodes):
            raise ConfigError("redis directory: give exactly one of url and cluster_nodes")
        for what, name in (("prefix", prefix), ("node_id", node_id or "x")):
            if not _NAME.fullmatch(name):
                raise ConfigError(f"redis directory: invalid {what} {name!r} (1-128 of [A-Za-z0-9._:/-])")
        if heartbeat_ttl_s <= 0 or block_ttl_s <= 0 or socket_timeout_s <= 0 or queue_limit <= 0:
            raise ConfigError("redis directory: ttls, timeout and queue_limit must be positive")
        self.node_id, self.endpoint = node_id, endpoint
        self.heartbeat_ttl_s, self.block_ttl_s, self.queue_limit = heartbeat_ttl_s, block_ttl_s, queue_limit
        self._p = f"tkv:{prefix}"
        self.stats = DirectoryStats()
        self._link = Link(lambda: make_client(url, cluster_nodes, socket_timeout_s), self.stats, max_backoff_s)
        self._cv = threading.Condition()
        self._queue: deque[tuple[bool, str, BlockHash]] = deque()
        self._announcing = Announcements()
        self._busy = 0  # updates taken off the queue, not yet applied
        self._closed = False
        self._records: dict[str, dict] = {}
        self._callbacks: list[Callable[[bool], None]] = []
        self._pending: list[Callable[[bool], None]] = []  # added after the last registration
        self._registered = False
        self._emptied = False  # whether the last re-announcement was to cover S3 too
        self._next_beat, self._announced_drops = 0.0, 0
        self._refresh_at = time.monotonic() + self._refresh_s()  # re-announce all before entries lapse
        self._epoch: bytes | None = None  # the Redis lifetime this node last saw
        self._started = time.time()
        self._thread = threading.Thread(target=self._run, name="tierkv-directory", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ keys
    def _node_key(self, node: str) -> str:
        return f"{{{self._p}:nodes}}:n:{node}"

    def _nodes_key(self, what: str) -> str:
        return f"{{{self._p}:nodes}}:{what}"

    def _block_key(self, h: BlockHash) -> str:
        return f"{self._p}:b:{h.hex()}"

    # ------------------------------------------------------------ state
    @property
    def available(self) -> bool:
        """False from a failed request until one succeeds again."""
        return self._link.up

    def location_of(self, tier_name: str) -> str | None:
        """Where tier `tier_name`'s blocks are in the directory (None: only this node sees it)."""
        if tier_name == "s3":
            return S3
        return self.node_id if tier_name == "disk" and self.node_id else None

    def on_register(self, callback: Callable[[bool], None]) -> None:
        """Call `callback(redis_was_empty)` on the directory thread after every (re)registration
        of this node, to re-announce what it holds; once soon if it registered before."""
        with self._cv:
            self._callbacks.append(callback)
            if self._registered:
                self._pending.append(callback)
                self._cv.notify_all()

    def nodes(self, fresh: bool = False) -> dict[str, dict]:
        """Live nodes: id -> record, as of the last heartbeat, or read now with `fresh` (if Redis answers)."""
        if fresh:
            records = self._link.call_or(self._read_nodes, "nodes", None)
            if records is not None:
                with self._cv:
                    self._records = records
        with self._cv:
            return dict(self._records)

    # ------------------------------------------------------------ blocks
    def announce(self, location: str, hashes: Sequence[BlockHash]) -> None:
        """Publish everything `location` holds again, paced (announcements.py)."""
        with self._cv:
            self._announcing.add(location, hashes)
            self._cv.notify_all()

    def publish(self, location: str, hashes: Iterable[BlockHash]) -> None:
        """Record (in the background) that `location` holds these blocks."""
        self._enqueue(True, location, hashes)

    def unpublish(self, location: str, hashes: Iterable[BlockHash]) -> None:
        """Record (in the background) that `location` no longer holds them."""
        self._enqueue(False, location, hashes)

    def _enqueue(self, add: bool, location: str, hashes: Iterable[BlockHash]) -> None:
        with self._cv:
            n = len(self._queue)
            self._queue.extend((add, location, h) for h in hashes)
            over = len(self._queue) - self.queue_limit
            for _ in range(max(0, over)):
                self._queue.popleft()
            if len(self._queue) != n:
                self._cv.notify_all()
        if over > 0:
            self.stats.add(dropped=over)

    def locate_many(self, hashes: Sequence[BlockHash]) -> list[frozenset[str]] | None:
        """Locations of each block ("s3" and ids of registered nodes holding
        it on disk), in one round trip; None when Redis cannot be used."""
        if not hashes:
            return []

        def op(r):
            p = r.pipeline(transaction=False)
            p.smembers(self._nodes_key("all"))  # registered nodes: records expired are pruned by heartbeats
            for h in hashes:
                p.smembers(self._block_key(h))
            return p.execute()

        try:
            live, *found = self._link.call(op, "locate")
        except Unavailable:
            return None
        self.stats.add(locates=1)
        live = set(map(text, live))
        return [frozenset(m for m in map(text, s) if m == S3 or m in live) for s in found]

    def in_s3(self, hashes: Sequence[BlockHash]) -> list[bool]:
        """Whether the directory knows each block to be in S3 (all False when Redis cannot be used)."""
        found = self.locate_many(hashes)
        return [False] * len(hashes) if found is None else [S3 in s for s in found]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued update is applied (not the paced re-announcements: a large
        disk's take a minute). False at once while Redis is unusable, or when `timeout` passes."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._queue or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if not self._link.up or (left is not None and left <= 0) or self._closed:
                    return False
                self._cv.wait(0.05 if left is None else min(left, 0.05))
        return True

    # ------------------------------------------------------------ background thread
    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed or self._pending or (self._queue and self._link.ready()),
                                  self._tick())
                if self._closed:
                    return
                late, self._pending = self._pending, []
            self._run_callbacks(late, self._emptied)
            if time.monotonic() >= self._next_beat and self._link.ready():
                self._heartbeat()
            self._drain()

    def _refresh_s(self) -> float:
        """Seconds to the next re-announcement of everything: under half the block TTL, spread (nodes started
        together do not all announce the whole bucket at once)."""
        return self.block_ttl_s * random.uniform(0.4, 0.5)

    def _tick(self) -> float:
        """Seconds until the next heartbeat, or the next probe while down."""
        wait = max(0.0, self._next_beat - time.monotonic())
        wait = min(wait, self._announcing.due_in() if self._announcing else wait)
        return max(0.01, min(wait, self._link.retry_in()) if not self._link.up else wait)

    def _heartbeat(self) -> None:
        """Refresh this node's record, then the live-node view; re-announcements owed are queued first."""
        try:
            if self.node_id:
                self._owe(*self._link.call(self._beat, "heartbeat", probe=True))  # this thread probes
            records = self._link.call(self._read_nodes, "nodes", probe=True)
        except Refused:  # Redis full, say: tried again at the usual pace
            self._next_beat = time.monotonic() + self.heartbeat_ttl_s / 3
            return
        except Unavailable:  # down: probed again after the backoff
            self._next_beat = time.monotonic() + self._link.retry_in()
            return
        with self._cv:
            self._records = records
        self._next_beat = time.monotonic() + self.heartbeat_ttl_s / 3

    def _owe(self, registered: bool, emptied: bool) -> None:
        """After a beat Redis took: on a (re)registration, Redis emptied,
        updates dropped since the last time, or half the block TTL gone, the
        callbacks re-publish holdings (all of them but on a plain
        registration); `_run` calls them, whatever the rest of this beat meets.
        One under way is not started over but for Redis emptied (it would never end)."""
        dropped, now = self.stats.dropped, time.monotonic()
        with self._cv:
            idle = not self._announcing
        everything = emptied or (idle and (dropped != self._announced_drops or now >= self._refresh_at))
        if not (registered or everything):
            return
        if everything:
            self._announced_drops, self._refresh_at = dropped, now + self._refresh_s()
        with self._cv:
            self._registered, self._emptied, self._pending = True, everything, list(self._callbacks)
            self._cv.notify_all()
        if registered:
            self.stats.add(registrations=1)

    @staticmethod
    def _run_callbacks(callbacks: list[Callable[[bool], None]], emptied: bool) -> None:
        for cb in callbacks:
            try:
                cb(emptied)
            except Exception:  # dispatch boundary: a callback bug must not stop heartbeats
                log.exception("redis directory: register callback failed")

    def _beat(self, r) -> tuple[bool, bool]:
        """Refresh the node record; (registered anew, Redis lost its data
        since this node last saw it, or is new)."""
        rec = json.dumps({"node_id": self.node_id, "endpoint": self.endpoint, "host": socket.gethostname(),
                          "pid": os.getpid(), "started_s": self._started})
        p = r.pipeline(transaction=True)
        p.set(self._node_key(self.node_id), rec, ex=max(1, round(self.heartbeat_ttl_s)), get=True)
        p.sadd(self._nodes_key("all"), self.node_id)
        p.set(self._nodes_key("epoch"), os.urandom(8).hex(), nx=True)
        p.get(self._nodes_key("epoch"))
        old, _, created, epoch = p.execute()
        emptied = bool(created) or (self._epoch is not None and epoch != self._epoch)
        self._epoch = epoch
        return old is None, emptied

    def _read_nodes(self, r) -> dict[str, dict]:
        ids = sorted(map(text, r.smembers(self._nodes_key("all"))))
        recs = r.mget([self._node_key(i) for i in ids]) if ids else []
        dead = [i for i, v in zip(ids, recs) if v is None]
        if dead:
            r.srem(self._nodes_key("all"), *dead)
        return {i: json.loads(v) for i, v in zip(ids, recs) if v is not None}

    def _drain(self) -> None:
        """Apply queued block updates, one pipeline per batch; a batch that
        met an outage goes back to the front of the queue."""
        while True:
            with self._cv:
                if len(self._queue) < _BATCH:  # re-announcements fill in behind live updates
                    self._queue.extend(self._announcing.take(_BATCH))
                if not self._queue or not self._link.ready() or time.monotonic() >= self._next_beat:
                    return  # a heartbeat due goes first: a long backlog must not let this node's record expire
                batch = [self._queue.popleft() for _ in range(min(_BATCH, len(self._queue)))]
                self._busy = len(batch)
            try:
                self._link.call(lambda r: self._apply(r, batch), "publish", probe=True)
            except Unavailable as e:
                refused = isinstance(e, Refused)  # answered with an error: not retried (as in _apply)
                with self._cv:
                    if not refused:
                        self._queue.extendleft(reversed(batch))
                    self._busy = 0
                    self._cv.notify_all()
                if refused:
                    self.stats.add(refused=len(batch))
                return
            added = sum(1 for add, _, _ in batch if add)
            self.stats.add(published=added, unpublished=len(batch) - added)
            with self._cv:
                self._busy = 0
                self._cv.notify_all()

    def _apply(self, r, batch: list[tuple[bool, str, BlockHash]]) -> None:
        p = r.pipeline(transaction=False)
        ttl = max(1, round(self.block_ttl_s))
        for add, where, h in batch:
            key = self._block_key(h)
            if add:
                p.sadd(key, where)
                p.expire(key, ttl)
            else:
                p.srem(key, where)
        errors = [e for e in p.execute(raise_on_error=False) if isinstance(e, Exception)]
        for e in errors:  # no answer from some node: an outage (the batch is queued again)
            if not answered(e):
                raise e
        if errors:  # refused (OOM, a key of another type): queued again they would block every update behind
            self.stats.add(refused=len(errors))
            self._link.refused(f"{len(errors)} of a batch's block updates", errors[0])

    def close(self, timeout: float = 2.0) -> None:
        """Apply what is queued (up to `timeout`), deregister, stop."""
        self.flush(timeout)
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout)
        if self.node_id and self._link.up:
            def bye(r):
                p = r.pipeline(transaction=True)
                p.delete(self._node_key(self.node_id))
                p.srem(self._nodes_key("all"), self.node_id)
                p.execute()

            self._link.call_or(bye, "deregister", None)
        self._link.close()

