"""Daemon authentication, tenants and TLS.

Tokens. ``tierkv serve --token-file FILE`` turns auth on: every RPC (except
the standard ``grpc.health.v1.Health`` service, so probes need no secret)
must carry ``authorization: Bearer <token>`` metadata, checked against FILE.
A missing or unknown token is UNAUTHENTICATED. FILE is either plain text,
one ``<token> <tenant>`` pair per line (``#`` comments), or, when it ends in
``.toml``, a ``[tokens]`` table of ``"<token>" = "<tenant>"``. Tokens are
compared by SHA-256 digest, so the table never holds them in clear and a
lookup does not leak them through timing. Without a token file auth is off:
anyone who can reach the port is trusted and picks its tenant in the request
(the default, meant for local development on 127.0.0.1).

Tenants. The token's tenant salts the namespace (``ns.with_tenant(tenant)``)
and the keys (`cache_service.blocks.keys.tenant_keys`) server-side, so a tenant that sends another
tenant's exact hashes still addresses different blocks, and its sessions live
in its own directory. A request naming a different tenant than its token's
is PERMISSION_DENIED.

TLS. ``--tls-cert`` and ``--tls-key`` (PEM files) serve TLS via
``grpc.ssl_server_credentials``; adding ``--tls-client-ca`` requires client
certificates signed by that CA (mutual TLS). Clients use
``grpc://host:port?tls=1&ca=/path/ca.pem`` (or ``TIERKV_TLS_CA``), plus
``&cert=/client.pem&key=/client.key`` for mutual TLS.
"""
from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path
from typing import Sequence

import grpc

from cache_service.sessions.manifests import SessionError, check_id
from cache_service.protocol.messages import RequestError
from tiers.types import ConfigError

MIN_TOKEN_CHARS = 16
_PUBLIC_PREFIX = "/grpc.health.v1.Health/"


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


def load_tokens(path: str | Path) -> dict[bytes, str]:
    """SHA-256(token) -> tenant from a token file (format in the module doc)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read token file {path}: {e.strerror}") from None
    if path.suffix == ".toml":
        try:
            pairs = list((tomllib.loads(text).get("tokens") or {}).items())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"token file {path} is not valid TOML: {e}") from None
    else:
        pairs = []
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ConfigError(f"token file {path}:{n}: expected '<token> <tenant>'")
            pairs.append((parts[0], parts[1]))
    table: dict[bytes, str] = {}
    for token, tenant in pairs:
        if not isinstance(token, str) or not isinstance(tenant, str) or len(token) < MIN_TOKEN_CHARS:
            raise ConfigError(f"token file {path}: tokens must be strings of at least {MIN_TOKEN_CHARS} characters")
        try:
            check_id(tenant, "tenant")
        except SessionError as e:
            raise ConfigError(f"token file {path}: {e}") from None
        table[_digest(token)] = tenant
    if not table:
        raise ConfigError(f"token file {path} holds no tokens")
    return table


class Authenticator:
    """Maps call metadata to a tenant; ``enabled`` is False without tokens."""

    def __init__(self, tokens: dict[bytes, str] | None = None) -> None:
        self._tokens = tokens or {}
        self.enabled = bool(self._tokens)

    def tenant_count(self) -> int:
        """Distinct tenants the tokens name (0 with auth off: callers then pick
        any tenant in their requests, so none is kept from another)."""
        return len(set(self._tokens.values()))

    @classmethod
    def from_file(cls, path: str | Path | None) -> "Authenticator":
        return cls(load_tokens(path) if path else None)

    def tenant_of(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
        """The caller's tenant; None when auth is off. UNAUTHENTICATED otherwise."""
        if not self.enabled:
            return None
        value = next((v for k, v in metadata or () if k == "authorization"), None)
        if value is None:
            raise RequestError(grpc.StatusCode.UNAUTHENTICATED, "missing 'authorization: Bearer <token>' metadata")
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise RequestError(grpc.StatusCode.UNAUTHENTICATED, "authorization metadata must be 'Bearer <token>'")
        tenant = self._tokens.get(_digest(token.strip()))
        if tenant is None:
            raise RequestError(grpc.StatusCode.UNAUTHENTICATED, "unknown token")
        return tenant

    @staticmethod
    def resolve(caller: str | None, requested: str) -> str:
        """The tenant a request acts as: the caller's own with auth on (naming
        another one is PERMISSION_DENIED), the requested one with auth off."""
        if caller is None:
            if requested:
                try:
                    check_id(requested, "tenant")
                except SessionError as e:
                    raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            return requested
        if requested and requested != caller:
            raise RequestError(grpc.StatusCode.PERMISSION_DENIED,
                               f"request names tenant {requested!r} but the token belongs to another tenant")
        return caller


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses calls without a valid token before any handler runs (every
    service but health); `on_reject(method, code)` counts the refusals."""

    def __init__(self, auth: Authenticator, on_reject=None) -> None:
        self._auth = auth
        self._on_reject = on_reject

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or not self._auth.enabled or details.method.startswith(_PUBLIC_PREFIX):
            return handler
        try:
            self._auth.tenant_of(details.invocation_metadata)
            return handler
        except RequestError as e:
            if self._on_reject is not None:
                self._on_reject(details.method, e.code)
            return _refusal(handler, e.code, str(e))


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    def refuse(request_or_iterator, context):
        context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)
