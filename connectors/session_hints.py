"""Session hints: what an agent runtime tells the cache about a conversation.

A request carries them in its ``kv_transfer_params`` (the field vLLM passes
from an OpenAI request to its KV connector; `tierkv serve-engine` reads the
same), under ``"tierkv"``::

    {"tierkv": {"session": "agent-7", "retain_s": 600}}   # pausing for a tool: keep my KV 10 min
    {"tierkv": {"session": "agent-7", "release": true}}   # this branch is done: let it go now
    {"tierkv": {"session": "agent-7", "prefetch": true}}  # I am about to resume: bring it up

- ``session`` + ``retain_s``: after the response, the conversation's blocks
  (prompt + output) are pinned in the store for that long (re-pinned, as the
  conversation grows, by every hinted turn), and its manifest is recorded, so
  the session is resumable on another node sharing S3 + Redis;
- ``release``: the session's pin goes at once (its blocks stay cached, evictable);
- ``prefetch``: the blocks of the session's recorded conversation are copied
  from disk / S3 into the CPU tier in the background, ahead of the next turn.

A sub-agent forked from its parent's prefix names its own session: the
blocks they share are the same blocks (same hashes), pinned while either
pin holds. Pins are capped per tenant by the store (pins.py).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

from cache_service.blocks.keys import Namespace
from cache_service.sessions.manifests import Manifests, Session, SessionError, check_id
from connectors.prefix import full_blocks
from tiers.types import BlockHash, TierKVError

log = logging.getLogger("tierkv.session_hints")
HINT_KEY = "tierkv"
MAX_RETAIN_S = 7 * 86400.0
_FIELDS = {"session", "retain_s", "release", "prefetch"}


class HintError(TierKVError):
    """Malformed session hints in a request."""


@dataclass(slots=True)
class SessionHint:
    """One request's hints (see the module docstring)."""

    session: str
    retain_s: float | None = None
    release: bool = False
    prefetch: bool = False

    def __post_init__(self) -> None:
        try:
            check_id(self.session)
        except SessionError as e:
            raise HintError(f"kv_transfer_params.tierkv.session: {e}") from None
        # NaN and infinities fail the range; a huge int compares too (math.isfinite raised OverflowError on it)
        if self.retain_s is not None and (isinstance(self.retain_s, bool) or not isinstance(self.retain_s, (int, float))
                                          or not 0 < self.retain_s <= MAX_RETAIN_S):
            raise HintError(f"kv_transfer_params.tierkv.retain_s must be seconds in (0, {MAX_RETAIN_S:.0f}], "
                            f"got {self.retain_s!r}")
        for name in ("release", "prefetch"):
            if not isinstance(getattr(self, name), bool):
                raise HintError(f"kv_transfer_params.tierkv.{name} must be true or false")
        if self.release and self.retain_s is not None:
            raise HintError("kv_transfer_params.tierkv: release and retain_s together")

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> "SessionHint | None":
        """The hints of a request's kv_transfer_params (None when it has none)."""
        if params is None:
            return None
        if not isinstance(params, Mapping):
            raise HintError("kv_transfer_params must be an object")
        raw = params.get(HINT_KEY)
        if raw is None:
            return None
        if not isinstance(raw, Mapping) or "session" not in raw:
            raise HintError('kv_transfer_params.tierkv must be an object with a "session"')
        unknown = set(raw) - _FIELDS
        if unknown:
            raise HintError(f"kv_transfer_params.tierkv: unknown keys {sorted(unknown)} (known: {sorted(_FIELDS)})")
        return cls(**raw)


class SessionPins(Protocol):
    """What a cache offers for session pins (the daemon's client, or `StorePins` over an embedded store)."""

    def pin_session(self, tenant: str, session: str, ns: Namespace, hashes: Sequence[BlockHash],
                    ttl_s: float | None) -> list[str]: ...

    def unpin_session(self, tenant: str, session: str) -> bool: ...


class StorePins:
    """`SessionPins` of an embedded store: its pin book (cache_service/store/pins.py)."""

    def __init__(self, store: Any) -> None:
        self.book = store.pins

    def pin_session(self, tenant: str, session: str, ns: Namespace, hashes: Sequence[BlockHash],
                    ttl_s: float | None) -> list[str]:
        return self.book.pin_session(tenant, session, hashes, ttl_s, ns.payload_bytes)

    def unpin_session(self, tenant: str, session: str) -> bool:
        return self.book.unpin_session(tenant, session)


def session_pins(client: Any) -> SessionPins:
    """The session-pin side of a cache client: the daemon's client pins itself; an embedded store, in its book."""
    return client if hasattr(client, "pin_session") else StorePins(client)


class SessionKeeper:
    """Acts on session hints for one engine namespace over a cache client."""

    def __init__(self, client: Any, ns: Namespace, manifests: Manifests | None = None, tenant: str = "",
                 model_id: str = "", durable_timeout_s: float | None = None) -> None:
        """`durable_timeout_s`: with manifests other nodes read, a manifest is
        recorded only after the store's writes below landed (up to this long),
        so it never names blocks still in flight; None: no wait."""
        self.client, self.ns = client, ns
        self.durable_timeout_s = durable_timeout_s
        self.manifests, self.tenant, self.model_id = manifests, tenant, model_id
        self.pins = session_pins(client)

    def finished(self, hint: SessionHint, token_ids: Sequence[int], messages: list[dict] | None = None) -> dict:
        """After a hinted response: pin (`retain_s`) or release, and record
        the manifest. `token_ids`: the tokens whose KV the engine computed
        (prompt + output but the last token). Returns what was done."""
        done: dict[str, Any] = {"session": hint.session}
        current = self.manifests.get(hint.session, self.tenant) if self.manifests is not None else None
        if self._other_model(current):  # its conversation is not this model's to take over
            raise HintError(f"session {hint.session!r} belongs to model {current.model_id}, not {self.model_id}")
        if hint.release:
            done["released"] = self.pins.unpin_session(self.tenant, hint.session)
        elif hint.retain_s is not None:
            keys = full_blocks(self.ns, token_ids)
            done["yielded"] = self.pins.pin_session(self.tenant, hint.session, self.ns, keys, hint.retain_s)
            done["pinned_blocks"] = len(keys)
        if self.manifests is not None and hint.release:
            self._unpinned(current)
        elif self.manifests is not None:
            self._record(hint, token_ids, messages)
        return done

    def _other_model(self, s: Session | None) -> bool:
        """Whether manifest `s` was recorded by another model than this keeper's."""
        return s is not None and bool(s.model_id) and bool(self.model_id) and s.model_id != self.model_id

    def _unpinned(self, s: Session | None) -> None:
        """A released session's manifest `s` no longer asks a resume to pin it."""
        if s is not None and s.pinned_until:
            s.pinned_until = 0.0
            self.manifests.put(s)

    def prefetch(self, session_id: str) -> int:
        """Promote the blocks of a recorded session into the top tier; how many
        were queued (0 for an unknown session or a cache that cannot)."""
        s = self.manifests.get(session_id, self.tenant) if self.manifests is not None else None
        if s is None or not hasattr(self.client, "prefetch") or self._other_model(s):
            return 0
        return self.client.prefetch(self.ns, full_blocks(self.ns, s.token_ids))

    def _record(self, hint: SessionHint, token_ids: Sequence[int], messages: list[dict] | None) -> None:
        flush = getattr(self.client, "flush", None)
        if self.durable_timeout_s and flush is not None and not flush(self.durable_timeout_s):
            log.warning("session %s: blocks not all written below within %.0fs", hint.session, self.durable_timeout_s)
        s = self.manifests.get(hint.session, self.tenant) or Session(hint.session, tenant=self.tenant)
        s.token_ids, s.model_id = list(token_ids), self.model_id
        s.namespace, s.block_tokens = self.ns.fingerprint().hex(), self.ns.block_tokens
        if messages is not None:
            s.messages = messages
        if hint.retain_s is not None:
            s.pinned_until = time.time() + hint.retain_s
        self.manifests.put(s)
