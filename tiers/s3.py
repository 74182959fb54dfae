"""S3 tier: block objects as S3 objects, shared by every node on the bucket.

Keys are content-addressed, ``<prefix>/<namespace hex>/<hh>/<hash hex>`` (hh:
the first hash byte, spreading keys over 256 S3 partitions), so a namespace (a
model, a layout, a tenant) can be listed, expired or deleted by prefix. A put's
namespace is read from the object's header (bytes 8..24); for reads the tier
knows the namespace of every block it listed or wrote, and the store names the
namespaces it loads under (`note_namespace`), so a block another node wrote
costs one GET per namespace in use (usually one).

Visibility and capacity. ``contains_many`` (on every lookup) is answered from
what this tier knows, never by a request: blocks listed at open, written here,
or found by ``get_many`` (which always asks S3) or ``refresh()``. Capacity
counts listed and written blocks, what ``keys()`` gives the store's policy;
blocks other nodes wrote later are served, not counted (a lifecycle rule,
``set_expiration``, is the bucket-wide backstop). A block no namespace has
(404) is reported by `take_gone`, for the directory.

Failures. 404 is a miss. Any other failure is a miss, or a put returning
False, counted in ``stats.errors`` and logged at a bounded rate; nothing is
raised to the store. After a transport failure or a 5xx the tier leaves S3
alone for a while (``s3_io.Outage``): an outage costs misses, not waits. Only
bad settings or credentials raise, at construction; an endpoint unreachable at
open is an outage (starts empty, lists once S3 answers).

Integrity is end to end: objects carry an xxh3 payload checksum the store
verifies on load (``verify_payload``), so botocore's per-request checksums are
left at "when required". Request helpers live in ``tiers/s3_io.py``.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Sequence, TypeVar

import boto3
import torch
import urllib3
from boto3.s3.transfer import TransferConfig
from botocore.exceptions import BotoCoreError, ClientError, ParamValidationError

from tiers import s3_io
from tiers.base import ByteBudget, Tier
from tiers.s3_deletes import PendingDeletes, S3Deletes
from tiers.s3_io import (AUTH, MIB, MISSING, NO_NS, Outage, Throttled, error_code, looks_down, namespace_of,
                         read_body, validate)
from tiers.types import BlockHash, ConfigError, TierKVError

log = logging.getLogger(__name__)

_MAX_FOREIGN = 1 << 20  # blocks remembered from other nodes (oldest forgotten first)
UNTICKED_S = 5.0  # a tier no writer ticked for this long lets its loads find out whether S3 is back
T = TypeVar("T")


class S3Tier(S3Deletes, ByteBudget, Tier):
    """Block objects in `bucket` under `prefix`; any S3-compatible endpoint.

    `endpoint_url` None means AWS; `access_key`/`secret_key` None use boto3's
    credential chain. Objects of `multipart_threshold` bytes or more are
    uploaded in parts. `retries` is botocore's retry count (standard mode)
    per request; `retry_after_s` is how long an unreachable S3 is left alone.
    """

    name = "s3"
    verify_payload = True
    remote = True  # a hit is copied up at once: a second read would cross the network again

    def __init__(self, bucket: str, *, capacity_bytes: int, prefix: str = "tierkv",
                 endpoint_url: str | None = None, region: str = "us-east-1",
                 access_key: str | None = None, secret_key: str | None = None,
                 addressing_style: str = "path", max_concurrency: int = 8,
                 multipart_threshold: int = 8 * MIB, connect_timeout: float = 2.0,
                 read_timeout: float = 10.0, retries: int = 2, retry_after_s: float = 2.0) -> None:
        validate(bucket, prefix, addressing_style, max_concurrency, multipart_threshold,
                 connect_timeout, read_timeout, retries, capacity_bytes)
        super().__init__(capacity_bytes)
        self.bucket, self.prefix = bucket, prefix
        self._outage = Outage(retry_after_s)

        session = boto3.session.Session()  # one per tier: boto3's default session is not safe to share across threads
        settings = dict(endpoint_url=endpoint_url, access_key=access_key, secret_key=secret_key, region=region,
                        addressing_style=addressing_style, connections=2 * max_concurrency,
                        connect_timeout=connect_timeout, read_timeout=read_timeout)
        self._client = s3_io.client(session, retries + 1, **settings)
        # Loads try once: a miss is recomputed, where each retry of an S3 that hangs costs the caller a timeout.
        self._reader = s3_io.client(session, 1, **settings)
        self._transfer = TransferConfig(multipart_threshold=multipart_threshold,
                                        multipart_chunksize=multipart_threshold,
                                        max_concurrency=max_concurrency)
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="tierkv-s3")
        self._lock = threading.Lock()
        self._opening = threading.Lock()  # the bucket's check and listing, when open could not do them
        self._index: dict[BlockHash, list[int]] = {}  # counted blocks: hash -> [size, last use ns]
        self._foreign: dict[BlockHash, int] = {}  # found, not counted: hash -> size
        self._ns: dict[BlockHash, str] = {}  # namespace hex of every block in _index or _foreign
        self._gone: list[BlockHash] = []  # answered 404 in every namespace tried (take_gone)
        self._undeleted = PendingDeletes(_MAX_FOREIGN)  # deletes S3 did not take, sent again by tick
        self._namespaces: dict[str, int] = {}  # namespaces seen or noted (-> object bytes, 0: unknown), most recent last
        self._used = self._reserved = 0
        self._ready = self._closed = self._probing = False  # bucket checked/created; closed; a tick's probe is out
        self._ticked = -UNTICKED_S  # when the writer's tick last ended (it probes S3 after a pause)
        self._warn = Throttled(log)
        self._open()

    # -- opening ----------------------------------------------------------------

    def key_of(self, h: BlockHash, ns: str | None = None) -> str:
        """The S3 key of block `h` in namespace `ns` (hex; default: the one this tier knows it under)."""
        ns = ns or self._ns.get(h) or NO_NS
        return f"{self.prefix}/{ns}/{h[0]:02x}/{h.hex()}"

    def note_namespace(self, fingerprint: bytes, object_bytes: int = 0) -> None:
        """The store loads blocks of this namespace: look for unknown blocks there."""
        with self._lock:
            size = self._namespaces.pop(fingerprint.hex(), 0)
            self._namespaces[fingerprint.hex()] = object_bytes or size  # most recent last

    def _candidates(self, h: BlockHash) -> list[str]:
        with self._lock:
            known = self._ns.get(h)
            return [known] if known else list(reversed(self._namespaces))

    def _open(self) -> None:
        """Make sure the bucket exists and index what it holds (unreachable: an outage; starts empty, retries)."""
        try:
            self._ensure_bucket()
        except (BotoCoreError, ClientError) as e:
            if error_code(e) in AUTH or isinstance(e, ParamValidationError):
                raise ConfigError(f"s3 tier: bucket {self.bucket!r}: {e}") from None
            log.warning("s3 tier: %s unreachable at open (%s); starting empty, listed once it answers",
                        self.bucket, e)
            self._outage.trip()
            return
        self._index_listing()

    def _index_listing(self) -> None:
        """Count every block under the prefix this tier does not know yet (at open, or after an outage at open)."""
        found = self._list()
        with self._lock:
            new = {h: v for h, v in found.items() if h not in self._index}
            for h, (size, mtime, ns) in new.items():
                self._foreign.pop(h, None)
                self._index[h] = [size, mtime]
                self._learn(h, ns)
            nbytes = sum(size for size, _, _ in new.values())
            self._used += nbytes
            self.stats.add(blocks=len(new), used_bytes=nbytes)

    def _ensure_bucket(self) -> None:
        s3_io.ensure_bucket(self._client, self.bucket)
        self._outage.answered()
        self._ready = True

    def _learn(self, h: BlockHash, ns: str) -> None:
        """Caller holds the lock: block `h` lives under namespace `ns`."""
        self._ns[h] = ns
        self._namespaces.setdefault(ns, 0)

    def _list(self) -> dict[BlockHash, tuple[int, int, str]]:
        """hash -> (size, last-modified ns, namespace hex) under the prefix; a listing cut short keeps what it got."""
        found: dict[BlockHash, tuple[int, int, str]] = {}
        try:
            for h, size, mtime, ns in s3_io.list_blocks(self._client, self.bucket, self.prefix):
                found[h] = (size, mtime, ns)
        except (BotoCoreError, ClientError) as e:
            self._fail("list", self.prefix, e)
        return found

    def refresh(self) -> int:
        """Re-list the prefix so blocks other nodes wrote since open answer
        `contains_many`; returns how many were new. (Not counted in capacity.)"""
        found = self._list()
        with self._lock:
            new = {h: s for h, (s, _, _) in found.items() if h not in self._index and h not in self._foreign}
            for h in new:
                self._learn(h, found[h][2])
            self._remember_foreign(new)
        return len(new)

    # -- writes -----------------------------------------------------------------

    def put_many(self, hashes: Sequence[BlockHash], objs: Sequence[torch.Tensor]) -> list[bool]:
        todo = self._admit(hashes, objs)
        try:
            ok = self._map(lambda i: self._put_one(hashes[i], objs[i]), todo)
        finally:
            with self._lock:
                self._reserved -= sum(objs[i].numel() for i in todo)
        done = [i for i, good in zip(todo, ok) if good]
        with self._lock:
            stamp = time.time_ns()
            for i in done:
                self._foreign.pop(hashes[i], None)
                self._index[hashes[i]] = [objs[i].numel(), stamp]
                self._learn(hashes[i], namespace_of(objs[i]))
            nbytes = sum(objs[i].numel() for i in done)
            self._used += nbytes
            self.stats.add(blocks=len(done), used_bytes=nbytes, bytes_in=nbytes)
            return [h in self._index for h in hashes]

    def _put_one(self, h: BlockHash, obj: torch.Tensor) -> bool:
        if not self._usable():
            self.stats.add(errors=1)
            return False
        key = self.key_of(h, namespace_of(obj))
        self._undeleted.discard(key)  # stored again: its earlier delete is not to be sent
        try:
            s3_io.upload(self._client, self.bucket, key, obj.cpu().numpy().tobytes(), self._transfer)
            self._outage.answered()
            return True
        except (BotoCoreError, ClientError) as e:
            self._fail("put", h.hex(), e)
            return False

    def _forget(self, hashes: Iterable[BlockHash]) -> int:
        """Drop blocks from this node's view (caller holds the lock); returns how many it knew of."""
        known = nbytes = counted = 0
        for h in hashes:
            e = self._index.pop(h, None)
            if e is not None:
                counted += 1
                nbytes += e[0]
            known += e is not None or self._foreign.pop(h, None) is not None
            self._ns.pop(h, None)
        self._used -= nbytes
        self.stats.add(blocks=-counted, used_bytes=-nbytes)
        return known

    # -- reads ------------------------------------------------------------------

    def get_many(self, hashes: Sequence[BlockHash]) -> list[torch.Tensor | None]:
        """Fresh 1-D uint8 tensors; a block this node did not know of is
        looked for too (another node may have written it)."""
        with self._lock:
            self._check_open()
        out = self._map(self._get_one, list(hashes))
        hits = [o.numel() for o in out if o is not None]
        self.stats.add(hits=len(hits), misses=len(out) - len(hits), bytes_out=sum(hits))
        return out

    def _get_one(self, h: BlockHash) -> torch.Tensor | None:
        tried = self._candidates(h)
        for ns in tried:
            if not self._readable():
                return None
            with self._lock:
                entry = self._index.get(h)  # a put landing while the GET is out replaces it
                size = entry[0] if entry else self._foreign.get(h) or self._namespaces.get(ns, 0)
            try:
                buf = read_body(self._reader.get_object(Bucket=self.bucket, Key=self.key_of(h, ns)), size)
                if buf is None:  # not the size of its block's object: damaged, and not read (it may be GiBs)
                    self._warn.warn("s3 tier: %s is not an object of %d bytes: quarantined", self.key_of(h, ns), size)
                    with self._lock:
                        self._learn(h, ns)
                    self.stats.add(corrupt=1)
                    self.quarantine([h])
                    return None
            except (BotoCoreError, ClientError, OSError, urllib3.exceptions.HTTPError) as e:
                if error_code(e) in MISSING:
                    self._outage.answered()
                    with self._lock:  # deleted by another node, or not in this namespace; not a fresh upload
                        if self._ns.get(h) == ns and self._index.get(h) is entry:
                            self._forget([h])
                    continue
                dropped = s3_io.transient(e)  # one reset is this load's miss; several with no answer, an outage
                self._fail("get", h.hex(), e, trip=not dropped)
                if dropped:
                    self._outage.dropped()
                return None
            self._outage.answered()
            with self._lock:
                e = self._index.get(h)
                if e is not None:
                    e[1] = time.time_ns()
                else:
                    self._learn(h, ns)
                    self._remember_foreign({h: buf.numel()})
            return buf
        if tried:  # not there in any namespace in use: whoever lists it in the directory is wrong now
            with self._lock:
                self._gone.append(h)
        return None

    def take_gone(self) -> list[BlockHash]:
        with self._lock:
            gone, self._gone = self._gone, []
        return gone

    def contains_many(self, hashes: Sequence[BlockHash]) -> list[bool]:
        """Whether each block is known to be in the bucket (no request made; see the module docstring)."""
        with self._lock:
            return [h in self._index or h in self._foreign for h in hashes]

    def keys(self) -> list[BlockHash]:
        """Counted blocks, least recently used (or modified, before open) first."""
        with self._lock:
            return sorted(self._index, key=lambda h: self._index[h][1])

    # -- admin ------------------------------------------------------------------

    def set_expiration(self, days: int) -> None:
        """Install (or replace) a bucket lifecycle rule expiring objects under
        this prefix `days` after they were written; other rules are kept.
        Raises TierUnavailableError if S3 refuses."""
        s3_io.set_expiration(self._client, self.bucket, self.prefix, days)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        self._client.close()
        self._reader.close()

    # -- helpers ----------------------------------------------------------------

    def _map(self, fn: Callable[[T], object], items: Sequence[T]) -> list:
        """fn over items on the bounded pool, results in order."""
        if len(items) <= 1:  # no hand-off for the common single-block call
            return [fn(x) for x in items]
        return list(self._pool.map(fn, items))

    def available(self) -> bool:
        """False while S3 is left alone after a failure that looked like an outage."""
        return self._outage.over()

    def tick(self) -> None:
        """After a pause, probe S3 (a HEAD of the bucket, on the writer's thread) before loads go back to it."""
        try:
            if self._outage.confirmed() or self._probe():
                super().tick()
        finally:
            self._ticked = time.monotonic()

    def _probe(self) -> bool:  # False: S3 did not answer (a bucket check at _usable is an answer too)
        self._probing = True
        try:
            if not self._usable():  # checks the bucket and lists it, if open could not
                return False
            if not self._outage.confirmed():
                self._reader.head_bucket(Bucket=self.bucket)
        except (BotoCoreError, ClientError) as e:
            self._fail("probe", self.bucket, e)
            if looks_down(e):
                return False  # a 403 or a 404 is an answer: S3 is there, whatever it thinks of the bucket
        finally:
            self._probing = False
        self._outage.answered()
        return True

    def _readable(self) -> bool:
        """Loads run on the engine's time (one probing a silent S3 waited out a read timeout): while S3
        has not answered since the last pause they miss and the writer's tick probes (loads probe once
        no tick came for UNTICKED_S since the pause ended: a tier no writer ticks)."""
        unticked = time.monotonic() - max(self._ticked, self._outage.ended()) >= UNTICKED_S and not self._probing
        ok = (self._outage.confirmed() or unticked) and self._usable()
        if not ok:
            self.stats.add(errors=1)
        return ok

    def _usable(self) -> bool:
        """False while S3 is being left alone after a failure; checks the bucket first if not done yet."""
        if not self.available():
            return False
        if not self._ready:
            with self._opening:  # once: the first request after an outage at open checks and lists
                if not self._ready:
                    if not self.available():  # the check just failed on another thread: not once per waiter
                        return False
                    try:
                        self._ensure_bucket()
                    except (BotoCoreError, ClientError) as e:
                        self._fail("open", self.bucket, e)
                        return False
                    self._index_listing()
        return True

    def _fail(self, op: str, what: str, e: Exception, trip: bool = True) -> None:
        """Count and log a failed request; leave S3 alone for a while if it looks down (transport, 5xx)."""
        self.stats.add(errors=1)
        if trip and looks_down(e):
            self._outage.trip()
        self._warn.warn("s3 tier: %s %s failed: %s", op, what, e)

    def _remember_foreign(self, sizes: dict[BlockHash, int]) -> None:
        """Caller holds the lock. Bounded: the oldest entries go first."""
        self._foreign.update(sizes)
        while len(self._foreign) > _MAX_FOREIGN:
            oldest = next(iter(self._foreign))
            del self._foreign[oldest]
            self._ns.pop(oldest, None)

    def _check_open(self) -> None:
        if self._closed:
            raise TierKVError(f"s3 tier {self.bucket}/{self.prefix} is closed")

