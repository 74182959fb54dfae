"""`tierkv stats` and `tierkv sessions`: a running daemon's counters and
session manifests, through its gRPC client.

    tierkv stats [--url grpc://127.0.0.1:7600] [--json]
    tierkv sessions list|show|delete [SESSION] [--url URL] [--tenant T] [--json]

Clients send the token in ``TIERKV_TOKEN`` when the daemon has auth on.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

DEFAULT_URL = "grpc://127.0.0.1:7600"


def _url_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=DEFAULT_URL, help="the daemon (default: %(default)s)")


def add_stats_args(p: argparse.ArgumentParser) -> None:
    _url_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")


_COLUMNS = ("blocks", "used_bytes", "capacity_bytes", "hits", "misses", "evictions", "corrupt", "queue_depth")


def run_stats(args: argparse.Namespace) -> int:
    from connectors.grpc.client import GrpcClient

    with GrpcClient(args.url, transport="stream") as client:
        tiers, daemon = client.stats(), client.daemon_stats()
    if args.json:
        print(json.dumps({"tiers": tiers, "daemon": daemon}))
        return 0
    width = max([len("tier")] + [len(t) for t in tiers])
    print(f"{'tier':<{width}} " + " ".join(f"{c:>14}" for c in _COLUMNS))
    for name, counters in tiers.items():
        print(f"{name:<{width}} " + " ".join(f"{counters.get(c, 0):>14}" for c in _COLUMNS))
    print(" ".join(f"{k}={v}" for k, v in daemon.items()))
    return 0


def add_sessions_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("list", "show", "delete"))
    p.add_argument("session", nargs="?", help="session id (show, delete)")
    _url_arg(p)
    p.add_argument("--tenant", default="", help="tenant (auth off only; with auth the token decides)")
    p.add_argument("--json", action="store_true", help="print JSON")


def run_sessions(args: argparse.Namespace) -> int:
    from connectors.grpc.client import GrpcClient

    if args.action != "list" and not args.session:
        print(f"tierkv sessions {args.action}: a session id is required", file=sys.stderr)
        return 2
    with GrpcClient(args.url, transport="stream") as client:
        if args.action == "list":
            ids = client.sessions.list(args.tenant)
            print(json.dumps(ids) if args.json else "\n".join(ids))
            return 0
        if args.action == "show":
            s = client.sessions.get(args.session, args.tenant)
            if s is None:
                print(f"tierkv: session {args.session!r} not found", file=sys.stderr)
                return 1
            data = dataclasses.asdict(s)
            if not args.json:
                data["token_ids"] = f"<{len(s.token_ids)} tokens>"
            print(json.dumps(data, indent=None if args.json else 2))
            return 0
        deleted = client.sessions.delete(args.session, args.tenant)
        print(f"{'deleted' if deleted else 'no such session'}: {args.session}", file=sys.stderr)
        return 0 if deleted else 1
