"""How many session manifests each tenant may keep on this daemon.

A tenant with a valid token could save manifests (up to
``server.max_message_bytes`` each) without end and fill the disk under the
sessions directory. The ids each tenant holds are listed once (at its first
save here) and kept as saves and deletes go; a save of a *new* session past
``server.max_sessions`` is refused, one that rewrites a session it has is
not. Sessions other nodes save into shared storage meanwhile are not seen
until the next listing (after a restart): the bound is per daemon, not exact.
"""
from __future__ import annotations

import threading
from typing import Callable

import grpc

from cache_service.protocol.messages import RequestError


class SessionQuota:
    """Per-tenant session ids, bounded (see the module docstring). Thread-safe."""

    def __init__(self, list_ids: Callable[[str], list[str]], limit: int) -> None:
        self._list, self.limit = list_ids, limit
        self._ids: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def admit(self, tenant: str, session_id: str) -> bool:
        """Count `session_id` for `tenant` (True: it is new); RESOURCE_EXHAUSTED if it is new and the
        tenant is at the limit."""
        ids = self._held(tenant)
        with self._lock:
            new = session_id not in ids
            if new and len(ids) >= self.limit:
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"{len(ids)} sessions saved already (server.max_sessions); delete one first")
            ids.add(session_id)
            return new

    def forget(self, tenant: str, session_id: str) -> None:
        with self._lock:
            self._ids.get(tenant, set()).discard(session_id)

    def _held(self, tenant: str) -> set[str]:
        with self._lock:
            ids = self._ids.get(tenant)
        if ids is None:  # listed outside the lock (a remote listing takes a while); the first listing wins
            listed = set(self._list(tenant))
            with self._lock:
                ids = self._ids.setdefault(tenant, listed)
        return ids
