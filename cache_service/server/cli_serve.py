"""`tierkv serve`: the standalone cache daemon (its admin commands, which are
clients: connectors/cli_admin.py).

    tierkv serve --config tierkv.toml [--listen 127.0.0.1:7600] [--metrics-port 9600] [--token-file F]

The daemon's settings are the config's [server] section (cache_service/config.py:
TOML, then TIERKV_SERVER__* env); each flag given overrides its key.
"""
from __future__ import annotations

import argparse
import logging
from dataclasses import replace
from typing import Any

from cache_service.config import ServerConfig, load_config
from cache_service.server.metrics import StructuredFormatter
from tiers.types import ConfigError


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The flags of `tierkv serve`; each one given overrides its key of the config's [server] section."""
    d = ServerConfig()
    p.add_argument("--config", default=None, help="TOML config of the store and the daemon "
                                                  "(default: built-in + TIERKV_* env)")
    p.add_argument("--listen", default=None, metavar="HOST:PORT", help=f"gRPC address (default: {d.listen})")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument("--metrics-host", default=None, help=f"address of the metrics endpoint (default: {d.metrics_host})")
    p.add_argument("--token-file", default=None, help="'<token> <tenant>' lines or a .toml [tokens] table; "
                                                      "turns auth on (default: off)")
    p.add_argument("--tls-cert", default=None, help="PEM certificate: serve TLS")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", default=None, help="require client certificates signed by this CA")
    p.add_argument("--sessions-dir", default=None, help="session manifests root (default: the disk tier's path)")
    p.add_argument("--data-port", default=None, metavar="PORT|off",
                   help="TCP port of the raw-bytes data path for streaming clients (default: any free port; "
                        "'off': stream through gRPC only; never opened with TLS)")
    p.add_argument("--grace", type=float, default=None, help=f"seconds in-flight calls get at shutdown "
                                                             f"(default: {d.grace_s:g})")
    p.add_argument("--workers", type=int, default=None, help=f"RPC worker threads (default: {d.workers})")
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="key=value lines or JSON lines (default: %(default)s)")


# flag dest -> [server] key
_FLAGS = {"listen": "listen", "metrics_port": "metrics_port", "metrics_host": "metrics_host",
          "token_file": "token_file", "tls_cert": "tls_cert", "tls_key": "tls_key", "tls_client_ca": "tls_client_ca",
          "sessions_dir": "sessions_dir", "grace": "grace_s", "workers": "workers"}


def run_serve(args: argparse.Namespace) -> int:
    from cache_service.server.daemon import serve

    formatter = StructuredFormatter(json_lines=args.log_format == "json")
    for handler in logging.getLogger().handlers:
        handler.setFormatter(formatter)
    logging.getLogger("tierkv").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    cfg = load_config(args.config)
    cfg.server = replace(cfg.server, **server_flags(args))  # re-validated, with the flags' own messages
    return serve(cfg)


def server_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The [server] keys the command line sets (the flags given)."""
    given = {key: getattr(args, dest) for dest, key in _FLAGS.items() if getattr(args, dest) is not None}
    if args.data_port is not None:
        given["data_port"] = _data_port(args.data_port)
    return given


def _data_port(value: str) -> int | None:
    if value == "off":
        return None
    if not value.isdigit() or int(value) > 65535:
        raise ConfigError(f"--data-port must be a port number or 'off', got {value!r}")
    return int(value)
