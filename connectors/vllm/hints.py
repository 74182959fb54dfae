"""Session hints under vLLM's own OpenAI server: a request's
``kv_transfer_params`` (vLLM hands the field of the OpenAI request to the
connector as ``request.kv_transfer_params``) may carry ``{"tierkv": {...}}``
(connectors/session_hints.py). The scheduler-side connector acts on them:
``prefetch`` when the request arrives, ``retain_s`` / ``release`` once it
finished, over the computed tokens of its conversation.

Hints run on one background thread, so the scheduler's step never waits on
a pin, a manifest write or a prefetch; a malformed hint or a cache that
cannot act on it is logged and counted, and the request goes on.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from cache_service.blocks.keys import Namespace
from cache_service.sessions.manifests import Manifests
from connectors.client import session_manifests
from connectors.session_hints import HintError, SessionHint, SessionKeeper
from tiers.types import TierKVError

log = logging.getLogger("vllm.tierkv")


def hint_manifests(url: str, config: str, client: Any) -> Manifests | None:
    """Session manifests for the hints: where `tierkv serve --config` keeps
    them (None, logged, when they cannot be opened: hints then pin only)."""
    try:
        return session_manifests(url, config or None, client)
    except TierKVError as e:
        log.warning("tierkv: session manifests unavailable (%s); hints pin without recording sessions", e)
        return None


class VllmSessionHints:
    """Acts on the session hints of vLLM requests (see the module docstring)."""

    def __init__(self, client: Any, namespace_of: Callable[[str], Namespace], manifests: Manifests | None,
                 tenant: str = "") -> None:
        self.client, self.namespace_of, self.manifests, self.tenant = client, namespace_of, manifests, tenant
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tierkv-hints")
        self.applied = self.errors = 0

    def arrived(self, params: Any, key_tenant: str) -> None:
        """A request arrived: a ``prefetch`` hint promotes its session's recorded blocks."""
        hint = self._hint(params)
        if hint is not None and hint.prefetch:
            self._pool.submit(self._run, lambda: self._keeper(key_tenant).prefetch(hint.session))

    def finished(self, params: Any, key_tenant: str, token_ids: Sequence[int]) -> None:
        """A request finished with `token_ids` computed: pin or release its session."""
        hint = self._hint(params)
        if hint is not None and (hint.retain_s is not None or hint.release):
            tokens = list(token_ids)
            self._pool.submit(self._run, lambda: self._keeper(key_tenant).finished(hint, tokens))

    def drain(self) -> None:
        """Wait until the hints handed over so far were acted on (one thread: in order)."""
        self._pool.submit(lambda: None).result()

    def close(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait)

    def _keeper(self, key_tenant: str) -> SessionKeeper:
        return SessionKeeper(self.client, self.namespace_of(key_tenant), self.manifests, self.tenant)

    def _hint(self, params: Any) -> SessionHint | None:
        try:
            return SessionHint.from_params(params)
        except HintError as e:
            log.warning("tierkv: ignoring the request's session hints: %s", e)
            self.errors += 1
            return None

    def _run(self, act: Callable[[], Any]) -> None:
        try:
            done = act()
            self.applied += 1
            log.info("tierkv: session hint applied: %s", done)
        except Exception:  # dispatch boundary: a hint the cache cannot act on costs the hint only
            log.exception("tierkv: applying a session hint failed")
            self.errors += 1
