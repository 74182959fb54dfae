"""`tierkv` command line: a lazy registry of subcommands (no if/elif ladder).

    tierkv generate --model smollm2 --prompt "..." [--kv-connector URL|none] [--json]
    tierkv chat --session ID [--model smollm2]
"""
from __future__ import annotations

import argparse
import logging
import sys

from tiers.registry import resolve

# name -> ("module:function adding its arguments", "module:function running it")
COMMANDS: dict[str, tuple[str, str, str]] = {
    "generate": ("engine.cli_generate:add_generate_args", "engine.cli_generate:run_generate",
                 "answer one prompt through the engine and the KV cache"),
    "chat": ("engine.cli_generate:add_chat_args", "engine.cli_generate:run_chat",
             "interactive chat; each turn resumes the session's KV"),
    "serve-engine": ("engine.cli_serve_engine:add_serve_engine_args", "engine.cli_serve_engine:run_serve_engine",
                     "serve the engine over an OpenAI-compatible HTTP API, with the KV cache"),
    "serve": ("cache_service.server.cli_serve:add_serve_args", "cache_service.server.cli_serve:run_serve",
              "run the standalone cache daemon (gRPC, metrics, health, auth)"),
    "stats": ("connectors.cli_admin:add_stats_args", "connectors.cli_admin:run_stats",
              "per-tier counters of a running daemon"),
    "sessions": ("connectors.cli_admin:add_sessions_args", "connectors.cli_admin:run_sessions",
                 "list, show or delete a daemon's session manifests"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierkv", description="Tiered KV-cache storage for LLM inference.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = next((a for a in argv if a in COMMANDS), None)
    for name, (add, _, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_)
        if name == wanted:  # import only the module of the command being run
            resolve(add)(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `tierkv` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from tiers.types import TierKVError

    try:
        return int(resolve(COMMANDS[args.command][1])(args) or 0)
    except TierKVError as e:
        print(f"tierkv: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
