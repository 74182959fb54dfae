"""Session manifests for agent resumption: (tenant, session id) -> the
conversation's messages and token ids, plus the namespace it was cached under.
The KV itself lives in the block store under keys derived from the token ids;
a manifest only says which tokens to resume.

Where manifests live (one API: get / put / list / delete):

- `SessionStore`: one JSON file per session under ``<root>/sessions/<tenant>/``,
  written to a temp name, fsynced and renamed (a crash leaves the old or the
  new manifest). One node's sessions.
- `S3Manifests` and `SharedSessionStore` (cache_service/sessions/shared.py):
  every node's sessions, in the deployment's bucket behind the Redis directory.

`SessionManager` puts manifests and an embedded store together (save, resume
with the number of tokens loadable now, pin with TTL, list, delete), through
`TenantView`: a tenant's keys are salted with the tenant, so another tenant
never finds, reads or pins its blocks, even given the right hashes.
"""
from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, Sequence

from cache_service.blocks.keys import Namespace, chain_hashes, tenant_keys
from tiers.types import BlockHash, TierKVError

if TYPE_CHECKING:
    import torch

    from cache_service.store.tiered_store import TieredStore

log = logging.getLogger("tierkv.sessions")

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class SessionError(TierKVError):
    """Unknown session, malformed id or unreadable manifest."""


@dataclass(slots=True)
class Session:
    """One conversation: what was said and the tokens its KV is keyed by."""

    session_id: str
    tenant: str = ""
    model_id: str = ""
    namespace: str = ""  # fingerprint hex
    messages: list[dict] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    updated_s: float = 0.0
    block_tokens: int = 0  # 0: not recorded (the resuming engine's block size is used)
    pinned_until: float = 0.0  # epoch seconds; 0: not pinned

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes | str, where: str) -> "Session":
        """Parse a manifest; keys a newer version added are ignored."""
        try:
            raw = json.loads(data)
            return cls(**{f.name: raw[f.name] for f in fields(cls) if f.name in raw})
        except (ValueError, TypeError) as e:
            raise SessionError(f"unreadable session manifest {where}: {e}") from None


class Manifests(Protocol):
    """What every manifest store offers."""

    def get(self, session_id: str, tenant: str = "") -> Session | None: ...

    def put(self, s: Session) -> None: ...

    def list(self, tenant: str = "") -> list[str]: ...

    def delete(self, session_id: str, tenant: str = "") -> bool: ...


def check_id(value: str, what: str = "session id") -> str:
    if not isinstance(value, str) or not _ID.match(value):
        raise SessionError(f"{what} {value!r} must be 1-128 of [A-Za-z0-9._-], not starting with . or -")
    return value


def check_ids(session_id: str, tenant: str) -> None:
    """SessionError unless the session id (and the tenant, if any) are valid ids."""
    check_id(session_id)
    if tenant:
        check_id(tenant, "tenant")


class SessionStore:
    """Manifests on the local filesystem (the embedded store's sessions)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root) / "sessions"

    def _path(self, tenant: str, session_id: str) -> Path:
        return self.root / (check_id(tenant, "tenant") if tenant else "_") / f"{check_id(session_id)}.json"

    def get(self, session_id: str, tenant: str = "") -> Session | None:
        """The manifest, or None when the session does not exist."""
        path = self._path(tenant, session_id)
        try:
            return Session.from_json(path.read_bytes(), str(path))
        except FileNotFoundError:
            return None
        except OSError as e:
            raise SessionError(f"session {session_id!r}: unreadable manifest {path}: {e}") from None

    def put(self, s: Session) -> None:
        """Write the manifest durably (temp file, fsync, rename)."""
        path = self._path(s.tenant, s.session_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        s.updated_s = time.time()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(asdict(s), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def list(self, tenant: str = "") -> list[str]:
        d = self.root / (check_id(tenant, "tenant") if tenant else "_")
        return sorted(p.stem for p in d.glob("*.json")) if d.is_dir() else []

    def delete(self, session_id: str, tenant: str = "") -> bool:
        try:
            self._path(tenant, session_id).unlink()
            return True
        except FileNotFoundError:
            return False


class TenantView:
    """One tenant's view of a store, usable wherever a CacheClient is: keys
    are ``tenant_keys(tenant, hashes)`` (as the daemon derives them) and
    objects are written and checked under ``ns.with_tenant(tenant)``. The
    empty tenant sees the store as is. `close` leaves the store open."""

    def __init__(self, store: "TieredStore", tenant: str = "") -> None:
        self.base, self.tenant = store, check_id(tenant, "tenant") if tenant else ""
        self._keys = tenant_keys

    def keys(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        return self._keys(self.tenant or None, hashes)

    def namespace(self, ns: Namespace) -> Namespace:
        return ns.with_tenant(self.tenant) if self.tenant else ns

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        return self.base.lookup(self.keys(hashes))

    def load(self, ns: Namespace, hashes: Sequence[BlockHash]) -> "list[torch.Tensor | None]":
        return self.base.load(self.namespace(ns), self.keys(hashes))

    def store(self, ns: Namespace, hashes: Sequence[BlockHash], payloads: "Sequence[torch.Tensor]") -> int:
        return self.base.store(self.namespace(ns), self.keys(hashes), payloads)

    def stats(self) -> dict[str, dict[str, int]]:
        return self.base.stats()

    def close(self) -> None:
        """A view owns nothing; close the store itself."""


@dataclass(slots=True)
class Resumed:
    session: Session
    loadable_tokens: int  # prefix of session.token_ids whose KV the store can load now


class SessionManager:
    """Agent sessions over an embedded store: save, resume, pin, list, delete.
    Every call names its tenant; a tenant sees only its own sessions and blocks."""

    def __init__(self, store: "TieredStore", manifests: Manifests) -> None:
        self.store, self.manifests = store, manifests

    def view(self, tenant: str = "") -> TenantView:
        """The client an engine of `tenant` should use (see TenantView)."""
        return TenantView(self.store, tenant)

    def save(self, tenant: str, session_id: str, token_ids: Sequence[int], ns: Namespace, *,
             messages: list[dict] | None = None, pin_ttl_s: float | None = None,
             durable_timeout_s: float | None = 60.0) -> Session:
        """Record the session's tokens. Blocks are flushed to the lower tiers
        first (up to `durable_timeout_s`), so the manifest another node reads
        never names blocks still in flight; `pin_ttl_s` pins them too."""
        s = self.manifests.get(session_id, tenant) or Session(check_id(session_id), tenant=tenant)
        s.token_ids, s.model_id = [int(t) for t in token_ids], ns.model_id
        s.namespace, s.block_tokens = ns.fingerprint().hex(), ns.block_tokens
        if messages is not None:
            s.messages = list(messages)
        if pin_ttl_s:
            self.store.pin(self._keys(s, ns), pin_ttl_s)
            s.pinned_until = time.time() + pin_ttl_s
        if durable_timeout_s and not self.store.flush(durable_timeout_s):
            log.warning("session %s: blocks not all written below within %.0fs", session_id, durable_timeout_s)
        self.manifests.put(s)
        return s

    def resume(self, tenant: str, session_id: str, ns: Namespace) -> Resumed | None:
        """The session and how many of its tokens are loadable now (0 when it
        was cached under another namespace); re-applies a live pin here."""
        s = self.manifests.get(session_id, tenant)
        if s is None:
            return None
        if s.namespace and s.namespace != ns.fingerprint().hex():
            return Resumed(s, 0)
        keys = self._keys(s, ns)
        left = s.pinned_until - time.time()
        if left > 0:
            self.store.pin(keys, left)
        return Resumed(s, self.store.lookup(keys) * (s.block_tokens or ns.block_tokens))

    def pin(self, tenant: str, session_id: str, ns: Namespace, ttl_s: float) -> bool:
        """Keep the session's blocks out of eviction for `ttl_s`, here and on
        every node that resumes it meanwhile; False if there is no session."""
        if ttl_s <= 0:
            raise SessionError(f"pin ttl must be positive, got {ttl_s}")
        s = self.manifests.get(session_id, tenant)
        if s is None:
            return False
        self.store.pin(self._keys(s, ns), ttl_s)
        s.pinned_until = time.time() + ttl_s
        self.manifests.put(s)
        return True

    def unpin(self, tenant: str, session_id: str, ns: Namespace) -> bool:
        s = self.manifests.get(session_id, tenant)
        if s is None:
            return False
        self.store.unpin(self._keys(s, ns))
        s.pinned_until = 0.0
        self.manifests.put(s)
        return True

    def list(self, tenant: str = "") -> list[str]:
        return self.manifests.list(tenant)

    def delete(self, tenant: str, session_id: str, ns: Namespace | None = None) -> bool:
        """Forget the session (its blocks stay cached, unpinned here)."""
        s = self.manifests.get(session_id, tenant) if ns is not None else None
        if s is not None:
            self.store.unpin(self._keys(s, ns))
        return self.manifests.delete(session_id, tenant)

    def _keys(self, s: Session, ns: Namespace) -> list[BlockHash]:
        """Store keys of the session's full blocks, chained from the namespace
        it was saved under, salted for its tenant."""
        root = bytes.fromhex(s.namespace) if s.namespace else ns.fingerprint()
        hashes = chain_hashes(root, s.token_ids, s.block_tokens or ns.block_tokens)
        return TenantView(self.store, s.tenant).keys(hashes)
