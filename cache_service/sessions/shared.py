"""Session manifests every node sees (the single-node ones and the
`Manifests` API: cache_service/sessions/manifests.py).

- `S3Manifests`: one object per session in the deployment's bucket, under
  ``<s3 prefix>-sessions/<tenant>/`` (outside the block prefix, so a
  lifecycle rule on blocks never expires a session).
- `PendingManifests`: S3 manifests with a local fallback: a manifest S3
  refuses (an outage) is written durably to local files and uploaded once S3
  answers, by a background thread (S3 stays the source of truth; the local
  copy is newer while it waits, so reads look there first).
- `SharedSessionStore`: the Redis directory beside one of those. The durable
  copy is the source of truth: written first, and read first (a write that
  missed Redis, during a restart say, leaves Redis a stale copy another node
  must not take for the session). Redis holds a copy of each manifest, each
  tenant's index and the pins: any node lists pins in one round trip, and
  reads and lists sessions there while the durable copy cannot be read.
  Writes that missed Redis are replayed once it answers again, and a read
  sets Redis's copy right.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from cache_service.sessions.manifests import (DamagedManifest, Manifests, Session, SessionError, SessionStore,
                                               check_id, check_ids)

log = logging.getLogger("tierkv.sessions")

if TYPE_CHECKING:
    from cache_service.config import S3Config
    from cache_service.directory.redis_directory import RedisDirectory


class S3Manifests:
    """Manifests as objects in the deployment's S3 bucket: durable and seen
    by every node. Raises SessionError when S3 cannot be used."""

    def __init__(self, cfg: "S3Config", prefix: str | None = None) -> None:
        import boto3  # lazy: only deployments with S3 pay for it
        from botocore.config import Config as BotoConfig

        self.bucket, self.prefix = cfg.bucket, prefix or f"{cfg.prefix}-sessions"
        boto = BotoConfig(region_name=cfg.region, s3={"addressing_style": cfg.addressing_style},
                          connect_timeout=cfg.connect_timeout, read_timeout=cfg.read_timeout,
                          retries={"mode": "standard", "total_max_attempts": cfg.retries + 1})
        self._client = boto3.session.Session().client(
            "s3", endpoint_url=cfg.endpoint or None, aws_access_key_id=cfg.access_key or None,
            aws_secret_access_key=cfg.secret_key or None, config=boto)

    def _key(self, tenant: str, session_id: str = "") -> str:
        t = check_id(tenant, "tenant") if tenant else "_"
        return f"{self.prefix}/{t}/" + (f"{check_id(session_id)}.json" if session_id else "")

    def _call(self, what: str, fn, *missing: str):
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn()
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in missing:
                return None
            raise SessionError(f"s3 manifests: {what} failed: {e}") from None
        except BotoCoreError as e:
            raise SessionError(f"s3 manifests: {what} failed: {e}") from None

    def get(self, session_id: str, tenant: str = "") -> Session | None:
        key = self._key(tenant, session_id)
        resp = self._call(f"get {key}", lambda: self._client.get_object(Bucket=self.bucket, Key=key),
                          "NoSuchKey", "404")
        return None if resp is None else Session.from_json(resp["Body"].read(), f"s3://{self.bucket}/{key}",
                                                           (session_id, tenant))

    def put(self, s: Session, keep_time: bool = False) -> None:
        """Write the manifest, stamped now (`keep_time`: as it was saved, for an upload that waited)."""
        key = self._key(s.tenant, s.session_id)
        if not keep_time:
            s.updated_s = time.time()
        self._call(f"put {key}", lambda: self._client.put_object(Bucket=self.bucket, Key=key, Body=s.to_json()))

    def list(self, tenant: str = "") -> list[str]:
        prefix = self._key(tenant)

        def ids() -> list[str]:
            pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
            keys = (o["Key"] for p in pages for o in p.get("Contents", ()))
            return [k[len(prefix):-len(".json")] for k in keys if k.endswith(".json")]

        return sorted(self._call(f"list {prefix}", ids))

    def delete(self, session_id: str, tenant: str = "") -> bool:
        key = self._key(tenant, session_id)
        head = self._call(f"head {key}", lambda: self._client.head_object(Bucket=self.bucket, Key=key),
                          "404", "NoSuchKey")
        self._call(f"delete {key}", lambda: self._client.delete_object(Bucket=self.bucket, Key=key))
        return head is not None


class PendingManifests:
    """`remote` (S3Manifests) with the manifests it refused kept in `local`
    (SessionStore, durable files) until a retry uploads them (module docstring)."""

    def __init__(self, remote: Manifests, local: SessionStore, retry_s: float = 5.0) -> None:
        self.remote, self.local, self.retry_s = remote, local, retry_s
        self._writing = threading.Lock()  # a retry's upload and a save of the same session, one at a time
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tierkv-manifests", daemon=True)
        self._thread.start()

    def _pending(self) -> list[tuple[str, str]]:
        """(tenant, id) of every manifest waiting to be uploaded."""
        if not self.local.root.is_dir():
            return []
        tenants = [d.name for d in self.local.root.iterdir() if d.is_dir()]
        return [("" if t == "_" else t, sid) for t in tenants for sid in self.local.list("" if t == "_" else t)]

    def upload_pending(self) -> int:
        """Upload what waits, oldest tenant first; stops at the first refusal. Returns how many are left."""
        left = self._pending()
        for tenant, sid in list(left):
            with self._writing:
                try:
                    self._upload(sid, tenant)
                except DamagedManifest as e:  # not S3 refusing: set aside, and the others go on
                    log.warning("session %s: %s; moved aside, not uploaded", sid, e)
                    self.local.set_aside(sid, tenant)
                except SessionError:
                    return len(left)
            left.remove((tenant, sid))
        return len(left)

    def _upload(self, sid: str, tenant: str) -> None:
        """The waiting copy to S3, unless S3 has a newer one (another node saved
        the session since); then the waiting copy goes (caller holds _writing)."""
        s = self.local.get(sid, tenant)
        if s is not None:
            try:
                there = self.remote.get(sid, tenant)
            except DamagedManifest:  # S3's copy is no manifest: the waiting one replaces it
                there = None
            if there is None or there.updated_s <= s.updated_s:
                self.remote.put(s, keep_time=True)
        self.local.delete(sid, tenant)

    def _run(self) -> None:
        while not self._stop.wait(self.retry_s):
            try:
                if self._pending():
                    self.upload_pending()
            except Exception:  # dispatch boundary: retried at the next tick
                log.exception("uploading pending manifests failed")

    def get(self, session_id: str, tenant: str = "") -> Session | None:
        return self.local.get(session_id, tenant) or self.remote.get(session_id, tenant)

    def put(self, s: Session) -> None:
        """To S3; when S3 refuses, durably to local files (acknowledged: uploaded later)."""
        try:
            with self._writing:
                self.remote.put(s)
                self.local.delete(s.session_id, s.tenant)  # an older one waiting must not overwrite this later
        except SessionError as e:
            self.local.put(s)
            log.warning("session %s: S3 refused its manifest (%s); kept on local disk until S3 answers",
                        s.session_id, e)

    def list(self, tenant: str = "") -> list[str]:
        return sorted(set(self.local.list(tenant)) | set(self.remote.list(tenant)))

    def delete(self, session_id: str, tenant: str = "") -> bool:
        existed = self.remote.delete(session_id, tenant)  # first: an outage here keeps a newer waiting copy
        return self.local.delete(session_id, tenant) or existed

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


class SharedSessionStore:
    """Manifests every node sees: the directory in front of `durable` (the
    source of truth; see the module docstring for the read and write paths)."""

    def __init__(self, directory: "RedisDirectory", durable: Manifests, owns_directory: bool = False,
                 shared_durable: bool = True) -> None:
        """`shared_durable`: every node reads the same durable copies (S3); else
        (this node's own files) Redis is the only shared copy, read first."""
        self.directory, self.durable, self._owns = directory, durable, owns_directory
        self.shared_durable = shared_durable
        self._dirty: dict[tuple[str, str], float] = {}  # (tenant, id) Redis may hold stale -> when it missed
        self._lock = threading.Lock()  # guards _dirty

    def get(self, session_id: str, tenant: str = "") -> Session | None:
        check_ids(session_id, tenant)
        self._repair()
        if self.shared_durable:
            try:
                s = self.durable.get(session_id, tenant)
            except DamagedManifest:  # Redis's copy if it has one; "no session" would start it over
                copy = self._redis_copy(tenant, session_id)
                if copy is None:
                    raise
                return copy
            except SessionError:  # the source of truth cannot be read now: Redis's copy, which may lag it
                return self._redis_copy(tenant, session_id)
            if self.directory.available:
                self._set_redis(tenant, session_id, s)
            return s
        with self._lock:  # a write of this node's that Redis missed (or refused): its own copy is newer
            missed = (tenant, session_id) in self._dirty
        s = None if missed else self._redis_copy(tenant, session_id)  # the only copy other nodes share
        if s is None:
            s = self.durable.get(session_id, tenant)  # this node's own; Redis lost it (a restart): refill
            if s is not None and self.directory.available and not missed:
                self._to_redis(s)
        return s

    def _redis_copy(self, tenant: str, session_id: str) -> Session | None:
        data = self.directory.get_manifest(tenant, session_id)
        return None if data is None else Session.from_json(data, f"redis {tenant or '_'}/{session_id}",
                                                           (session_id, tenant))

    def _set_redis(self, tenant: str, session_id: str, s: Session | None) -> None:
        """Make Redis's copy the durable one (Redis lost it, or kept one a missed write left stale)."""
        data = self.directory.get_manifest(tenant, session_id)
        if s is None and data is not None:
            self.directory.delete_manifest(tenant, session_id)
        elif s is not None and data != s.to_json():
            self._to_redis(s)

    def put(self, s: Session) -> None:
        """Durable copy first (SessionError if that fails), then Redis."""
        check_ids(s.session_id, s.tenant)
        self._repair()
        self.durable.put(s)
        self._to_redis(s)

    def _to_redis(self, s: Session) -> None:
        if not self.directory.put_manifest(s.tenant, s.session_id, s.to_json(), s.pinned_until):
            with self._lock:
                self._dirty[(s.tenant, s.session_id)] = time.time()

    def list(self, tenant: str = "") -> list[str]:
        check_ids("x", tenant)
        self._repair()
        if not self.shared_durable:  # less the ones deleted here that Redis missed (as `get` answers them)
            here = set(self.durable.list(tenant))
            with self._lock:
                gone = {sid for t, sid in self._dirty if t == tenant} - here
            return sorted((set(self.directory.list_manifests(tenant) or ()) | here) - gone)
        try:
            return sorted(self.durable.list(tenant))
        except SessionError:  # as `get`: Redis's index while the durable copies cannot be listed
            return sorted(self.directory.list_manifests(tenant) or ())

    def delete(self, session_id: str, tenant: str = "") -> bool:
        check_ids(session_id, tenant)
        self._repair()
        at = time.time()  # before Redis is tried: a save another node makes while this waits on it is later
        existed = self.durable.delete(session_id, tenant)
        gone = self.directory.delete_manifest(tenant, session_id)
        if gone is None:
            with self._lock:
                self._dirty[(tenant, session_id)] = at
        return existed or bool(gone)

    def pins(self, tenant: str = "") -> dict[str, float]:
        """Pinned sessions of a tenant: id -> until (epoch s)."""
        check_ids("x", tenant)
        got = self.directory.pins(tenant)
        if got is None:  # Redis unusable: read the manifests
            now = time.time()
            got = {sid: s.pinned_until for sid in self.durable.list(tenant)
                   if (s := self.durable.get(sid, tenant)) is not None and s.pinned_until > now}
        return got

    def _newer_in_redis(self, tenant: str, sid: str, since: float) -> bool:
        """Whether Redis holds a save of the session made after `since` (another
        node's): a replayed save or delete from before must not undo it. By
        `updated_s`, each saving node's clock: they must agree to better than
        the time between two saves of one session (NTP does)."""
        if self.shared_durable:  # the durable copy read for the replay is the latest there is
            return False
        try:
            there = self._redis_copy(tenant, sid)
        except DamagedManifest:
            return False
        return there is not None and there.updated_s > since

    def close(self) -> None:
        if self._owns:
            self.directory.close()
        close = getattr(self.durable, "close", None)
        if close is not None:
            close()

    def _repair(self) -> None:
        """Replay writes that missed Redis (in order) once it answers: the
        durable copy as it is now, or a delete where there is none."""
        while self._dirty and self.directory.available:
            with self._lock:
                if not self._dirty:
                    return
                (tenant, sid), missed_s = next(iter(self._dirty.items()))
            try:
                s = self.durable.get(sid, tenant)
            except DamagedManifest as e:  # not replayable; it must not fail every session call on this node
                log.warning("session %s: %s; Redis's copy left as it is", sid, e)
                with self._lock:
                    self._dirty.pop((tenant, sid), None)
                continue
            except SessionError:  # the durable copies cannot be read now: replayed at a later call
                return
            ok = self._newer_in_redis(tenant, sid, missed_s if s is None else s.updated_s) or (
                self.directory.delete_manifest(tenant, sid) is not None if s is None else
                self.directory.put_manifest(tenant, sid, s.to_json(), s.pinned_until))
            if not ok:
                return
            with self._lock:
                self._dirty.pop((tenant, sid), None)
