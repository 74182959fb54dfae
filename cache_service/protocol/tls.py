"""TLS credentials of the daemon and its clients (PEM files; see
cache_service/server/auth.py for how the daemon uses them)."""
from __future__ import annotations

import ssl
from pathlib import Path

import grpc

from tiers.types import ConfigError


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e.strerror}") from None


def server_credentials(cert: str, key: str, client_ca: str | None = None) -> grpc.ServerCredentials:
    """TLS credentials for the daemon; with `client_ca`, clients must present certificates."""
    ca = _read(client_ca, "TLS client CA") if client_ca else None
    pem = _read(key, "TLS key")
    if b"ENCRYPTED" in pem:  # gRPC cannot use it; OpenSSL would ask for its passphrase
        raise ConfigError(f"TLS key {key} is encrypted (passphrase-protected): give the key unencrypted")
    try:  # grpc says only "failed to bind" for a key that is not the certificate's
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as e:
        raise ConfigError(f"TLS certificate {cert} and key {key} do not go together ({e.reason or e})") from None
    except OSError as e:
        raise ConfigError(f"cannot read TLS certificate {cert} or key {key}: {e.strerror or e}") from None
    return grpc.ssl_server_credentials([(pem, _read(cert, "TLS certificate"))],
                                       root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(ca: str | None = None, cert: str | None = None,
                        key: str | None = None) -> grpc.ChannelCredentials:
    """TLS credentials for a client (system roots when `ca` is None); `cert`
    and `key` (mutual TLS) come together."""
    if bool(cert) != bool(key):  # grpc aborts the process on one without the other
        raise ConfigError("TLS client certificate and key come together: give both cert= and key=, or neither")
    return grpc.ssl_channel_credentials(root_certificates=_read(ca, "TLS CA") if ca else None,
                                        private_key=_read(key, "TLS key") if key else None,
                                        certificate_chain=_read(cert, "TLS certificate") if cert else None)
