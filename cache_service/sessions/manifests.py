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

`SessionManager` puts manifests and a store together (save with a pin, resume
with the number of blocks loadable now, list, delete); the daemon serves its
session calls through it. A tenant's keys are salted with the tenant, so
another tenant never finds, reads or pins its blocks, even given the right hashes.
"""
from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from cache_service.blocks.keys import Namespace, chain_hashes, tenant_keys
from tiers.types import BlockHash, TierKVError

if TYPE_CHECKING:
    from cache_service.store.tiered_store import TieredStore

log = logging.getLogger("tierkv.sessions")

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class SessionError(TierKVError):
    """Unknown session, malformed id or unreadable manifest."""


class DamagedManifest(SessionError):
    """A manifest was read but is not one (not JSON, wrong field types, another session's)."""


_TYPES = {"session_id": str, "tenant": str, "model_id": str, "namespace": str, "messages": list, "token_ids": list,
          "updated_s": (int, float), "block_tokens": int, "pinned_until": (int, float)}


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
    def from_json(cls, data: bytes | str, where: str, key: tuple[str, str] | None = None) -> "Session":
        """Parse a manifest (DamagedManifest unless each field has its type and, given the `key`
        (session id, tenant) it was stored under, it is that session's); newer versions' keys are ignored."""
        try:
            raw = json.loads(data)
            s = cls(**{f.name: raw[f.name] for f in fields(cls) if f.name in raw})
        except (ValueError, TypeError) as e:
            raise DamagedManifest(f"unreadable session manifest {where}: {e}") from None
        bad = [k for k, t in _TYPES.items() if not isinstance(getattr(s, k), t) or getattr(s, k) is True and t is int]
        bad += [] if all(isinstance(m, dict) for m in s.messages) else ["messages"]
        bad += [] if all(type(t) is int for t in s.token_ids) else ["token_ids"]
        if bad or (key is not None and key != (s.session_id, s.tenant)):
            why = f"fields {sorted(set(bad))} of the wrong type" if bad else \
                f"it is session {s.session_id!r} of tenant {s.tenant!r}"
            raise DamagedManifest(f"unreadable session manifest {where}: {why}")
        return s


class Manifests(Protocol):
    """What every manifest store offers."""

    def get(self, session_id: str, tenant: str = "") -> Session | None: ...

    def put(self, s: Session) -> None: ...

    def list(self, tenant: str = "") -> list[str]: ...

    def delete(self, session_id: str, tenant: str = "") -> bool: ...


def check_id(value: str, what: str = "session id") -> str:
    if not isinstance(value, str) or not _ID.fullmatch(value):  # match's $ let a trailing newline through
        shown = repr(value[:64]) + (f"... ({len(value)} characters)" if len(value) > 64 else "") \
            if isinstance(value, str) else type(value).__name__  # not echoed whole: into logs and error replies
        raise SessionError(f"{what} {shown} must be 1-128 of [A-Za-z0-9._-], not starting with . or -")
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
            return Session.from_json(path.read_bytes(), str(path), (session_id, tenant))
        except FileNotFoundError:
            return None
        except OSError as e:
            raise SessionError(f"session {session_id!r}: unreadable manifest {path}: {e}") from None

    def put(self, s: Session) -> None:
        """Write the manifest durably (temp file, fsync, rename)."""
        path = self._path(s.tenant, s.session_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        s.updated_s = time.time()
        # one temp file per writer: the daemon's workers may save one session at once
        tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_native_id()}.tmp")
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

    def set_aside(self, session_id: str, tenant: str = "") -> None:
        """Move a damaged manifest out of the way (kept beside, for inspection)."""
        path = self._path(tenant, session_id)
        try:
            os.replace(path, path.with_name(f"{path.name}.damaged-{time.time_ns()}"))
        except FileNotFoundError:
            pass


class SessionManager:
    """Sessions over a store: manifests (any `Manifests`) plus the pins of their
    blocks. The daemon's session calls (cache_service/server/servicer.py) run here.

    `owner` names whose manifest it is; `key_tenant` salts the store keys of
    the session's blocks (`tenant_keys`; None: the unsalted keys of a daemon
    with auth off), so a tenant never finds or pins another tenant's blocks.
    """

    def __init__(self, store: "TieredStore", manifests: Manifests, durable_timeout_s: float | None = None) -> None:
        """`durable_timeout_s`: `save` first waits (up to this long) for the
        blocks to be written to the lower tiers; None: it does not wait."""
        self.store, self.manifests, self.durable_timeout_s = store, manifests, durable_timeout_s

    def save(self, s: Session, ns: Namespace | None = None, *, key_tenant: str | None = None, pin: bool = False,
             pin_ttl_s: float | None = None) -> Session:
        """Write the manifest `s`. With `pin` (needs `ns`) its blocks are pinned,
        for `pin_ttl_s` seconds (recorded in the manifest, so a node that resumes
        it pins them too) or, with None, until unpinned. Blocks are flushed below
        first when the manager is durable, so a manifest another node reads
        never names blocks still in flight."""
        keys = self.keys(s, ns, key_tenant) if pin else []
        if pin_ttl_s and pin:
            s.pinned_until = time.time() + pin_ttl_s
        if self.durable_timeout_s and not self.store.flush(self.durable_timeout_s):
            log.warning("session %s: blocks not all written below within %.0fs", s.session_id, self.durable_timeout_s)
        self.manifests.put(s)
        if keys:  # a session pin: blocks it shares with another session stay pinned while either pin lives
            self.store.pins.pin_session(s.tenant, s.session_id, keys, pin_ttl_s, ns.payload_bytes)
        return s

    def resume(self, owner: str, session_id: str, ns: Namespace | None = None, *,
               key_tenant: str | None = None) -> tuple[Session | None, int]:
        """(the manifest or None, how many blocks of its token prefix the store
        can load now: 0 without `ns` or when it was cached under another
        namespace). With `ns`, re-applies a live pin here."""
        s = self.manifests.get(session_id, owner)
        if s is None or ns is None or (s.namespace and s.namespace != ns.fingerprint().hex()):
            return s, 0
        keys = self.keys(s, ns, key_tenant)
        left = s.pinned_until - time.time()
        if left > 0:
            self.store.pins.pin_session(owner, session_id, keys, left, ns.payload_bytes)
        return s, self.store.lookup(keys)

    def list(self, owner: str = "") -> list[str]:
        return self.manifests.list(owner)

    def delete(self, owner: str, session_id: str) -> bool:
        """Forget the session and release its pin (its blocks stay cached, and
        stay pinned while another session's pin covers them)."""
        self.store.pins.unpin_session(owner, session_id)
        return self.manifests.delete(session_id, owner)

    @staticmethod
    def keys(s: Session, ns: Namespace, key_tenant: str | None) -> list[BlockHash]:
        """Store keys of the session's full blocks, chained from the namespace
        it was saved under (else `ns`), salted for `key_tenant`. ValueError for
        token ids that are not int32."""
        root = bytes.fromhex(s.namespace) if s.namespace else ns.fingerprint()
        if len(root) != 16:
            raise ValueError(f"session namespace {s.namespace!r:.40} is not a fingerprint (32 hex digits)")
        return tenant_keys(key_tenant, chain_hashes(root, s.token_ids, s.block_tokens or ns.block_tokens))
