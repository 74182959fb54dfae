"""`RemoteSessions`: a daemon's session manifests, through a `GrpcClient`'s admin calls."""
from __future__ import annotations

from typing import Callable

from cache_service.blocks.keys import Namespace
from cache_service.sessions.manifests import Session, SessionError
from cache_service.protocol.messages import ns_to_pb, session_from_pb, session_to_pb
from proto import tierkv_pb2 as pb


def _ns(ns: Namespace | None) -> pb.Namespace | None:
    return ns_to_pb(ns) if ns else None


class RemoteSessions:
    """The daemon's session manifests, with the `SessionStore` interface
    (get/put/list/delete) plus `resume`. With auth on the token's tenant is
    used and `tenant` arguments must be empty or equal to it."""

    def __init__(self, admin: Callable) -> None:
        """`admin(name, request, invalid=...)`: a unary call whose failure raises (GrpcClient.admin)."""
        self._admin = admin

    def _call(self, name: str, request):
        return self._admin(name, request, invalid=SessionError)

    def get(self, session_id: str, tenant: str = "") -> Session | None:
        return self.resume(session_id, tenant)[0]

    def resume(self, session_id: str, tenant: str = "", ns: Namespace | None = None) -> tuple[Session | None, int]:
        """(manifest or None, blocks of its token prefix the daemon holds; 0 without `ns`)."""
        req = pb.ResumeSessionRequest(session_id=session_id, tenant=tenant, ns=_ns(ns))
        reply = self._call("ResumeSession", req)
        return (session_from_pb(reply.session) if reply.found else None), reply.cached_blocks

    def put(self, s: Session, ns: Namespace | None = None, pin: bool = False, pin_ttl_s: float | None = None) -> None:
        """Save the manifest durably; with `pin` (needs `ns`) pin its blocks."""
        req = pb.SaveSessionRequest(session=session_to_pb(s), ns=_ns(ns), pin=pin,
                                    pin_ttl_s=pin_ttl_s or 0.0)
        saved = self._call("SaveSession", req).session
        s.tenant, s.updated_s = saved.tenant, saved.updated_s

    def list(self, tenant: str = "") -> list[str]:
        return list(self._call("ListSessions", pb.ListSessionsRequest(tenant=tenant)).session_ids)

    def delete(self, session_id: str, tenant: str = "", ns: Namespace | None = None) -> bool:
        """Remove the manifest; with `ns`, unpin its blocks too."""
        req = pb.DeleteSessionRequest(session_id=session_id, tenant=tenant, ns=_ns(ns))
        return self._call("DeleteSession", req).deleted
