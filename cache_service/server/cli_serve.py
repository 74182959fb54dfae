"""`tierkv serve`: the standalone cache daemon (its admin commands, which are
clients: connectors/cli_admin.py).

    tierkv serve --config tierkv.toml [--listen 127.0.0.1:7600] [--metrics-port 9600] [--token-file F]
"""
from __future__ import annotations

import argparse
import logging

from cache_service.config import load_config
from cache_service.server.metrics import StructuredFormatter

def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="TOML config of the store (default: built-in + TIERKV_* env)")
    p.add_argument("--listen", default="127.0.0.1:7600", metavar="HOST:PORT",
                   help="gRPC address (default: %(default)s)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics endpoint (default: %(default)s)")
    p.add_argument("--token-file", default=None, help="'<token> <tenant>' lines or a .toml [tokens] table; "
                                                      "turns auth on (default: off)")
    p.add_argument("--tls-cert", default=None, help="PEM certificate: serve TLS")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", default=None, help="require client certificates signed by this CA")
    p.add_argument("--sessions-dir", default=None, help="session manifests root (default: the disk tier's path)")
    p.add_argument("--lane-port", default="0", metavar="PORT|off",
                   help="TCP port of the raw-bytes data lane for streaming clients (default: any free port; "
                        "'off': stream through gRPC only; never opened with TLS)")
    p.add_argument("--grace", type=float, default=10.0, help="seconds in-flight calls get at shutdown")
    p.add_argument("--workers", type=int, default=16, help="RPC worker threads")
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="key=value lines or JSON lines (default: %(default)s)")


def run_serve(args: argparse.Namespace) -> int:
    from cache_service.server.daemon import serve
    from cache_service.server.servicer import ServerSettings

    formatter = StructuredFormatter(json_lines=args.log_format == "json")
    for handler in logging.getLogger().handlers:
        handler.setFormatter(formatter)
    logging.getLogger("tierkv").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    settings = ServerSettings(listen=args.listen, metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                              token_file=args.token_file, tls_cert=args.tls_cert, tls_key=args.tls_key,
                              tls_client_ca=args.tls_client_ca, sessions_dir=args.sessions_dir,
                              grace_s=args.grace, workers=args.workers, lane_port=_lane_port(args.lane_port))
    return serve(load_config(args.config), settings)


def _lane_port(value: str) -> int | None:
    if value == "off":
        return None
    if not value.isdigit() or int(value) > 65535:
        raise SystemExit(f"--lane-port must be a port number or 'off', got {value!r}")
    return int(value)
