"""The Redis directory's session keys (cache_service/directory/redis_directory.py
names them all): a manifest, a tenant's index of sessions and its pins,
under one hash tag per tenant so that saving a session is one MULTI/EXEC.
Used by cache_service/sessions/shared.py."""
from __future__ import annotations

import time

from cache_service.directory.redis_link import Link, text


class SessionKeys:
    """Manifests and pins in Redis; mixed into RedisDirectory (its `_link` and `_p`)."""

    _link: Link
    _p: str

    def _tenant_key(self, tenant: str, what: str) -> str:
        assert "{" not in tenant and "}" not in tenant and "{" not in what
        return f"{{{self._p}:t:{tenant or '_'}}}:{what}"

    def put_manifest(self, tenant: str, session_id: str, data: bytes, pinned_until: float = 0.0) -> bool:
        """Store a manifest, index it, and set or clear its pin: one MULTI/EXEC."""
        def op(r):
            p = r.pipeline(transaction=True)
            p.set(self._tenant_key(tenant, f"s:{session_id}"), data)
            p.sadd(self._tenant_key(tenant, "index"), session_id)
            pins = self._tenant_key(tenant, "pins")
            if pinned_until > time.time():
                p.zadd(pins, {session_id: pinned_until})
            else:
                p.zrem(pins, session_id)
            p.execute()
            return True

        return self._link.call_or(op, "put session", False)

    def get_manifest(self, tenant: str, session_id: str) -> bytes | None:
        """The manifest, or None (absent, or Redis unusable)."""
        return self._link.call_or(lambda r: r.get(self._tenant_key(tenant, f"s:{session_id}")),
                                  "get session", None)

    def list_manifests(self, tenant: str) -> list[str] | None:
        """The tenant's session ids; None when Redis cannot be used."""
        ids = self._link.call_or(lambda r: r.smembers(self._tenant_key(tenant, "index")),
                                 "list sessions", None)
        return None if ids is None else sorted(map(text, ids))

    def delete_manifest(self, tenant: str, session_id: str) -> bool | None:
        """Remove a manifest, its index entry and its pin; whether it existed
        (None when Redis cannot be used)."""
        def op(r):
            p = r.pipeline(transaction=True)
            p.delete(self._tenant_key(tenant, f"s:{session_id}"))
            p.srem(self._tenant_key(tenant, "index"), session_id)
            p.zrem(self._tenant_key(tenant, "pins"), session_id)
            return bool(p.execute()[0])

        return self._link.call_or(op, "delete session", None)

    def pins(self, tenant: str) -> dict[str, float] | None:
        """Pinned sessions of a tenant: id -> pinned until (epoch s); expired
        pins are dropped. None when Redis cannot be used."""
        def op(r):
            key, now = self._tenant_key(tenant, "pins"), time.time()
            p = r.pipeline(transaction=True)
            p.zremrangebyscore(key, "-inf", now)
            p.zrangebyscore(key, now, "+inf", withscores=True)
            return p.execute()[1]

        got = self._link.call_or(op, "pins", None)
        return None if got is None else {text(k): float(v) for k, v in got}
