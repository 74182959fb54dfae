"""`tierkv serve-engine`: our engine behind an OpenAI-compatible API, with the KV cache attached.

    tierkv serve-engine --model smollm2 --kv-connector local:///var/cache/tierkv --port 8000
    # then, from any OpenAI client:
    #   client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
"""
from __future__ import annotations

import argparse
import logging
import sys

from cache_service.config import parse_size
from connectors.client import connect, session_manifests
from connectors.engine import EngineConnector
from connectors.session_hints import SessionKeeper
from engine.llm import LLM
from tiers.types import TierUnavailableError

log = logging.getLogger("tierkv.serve_engine")
DURABLE_TIMEOUT_S = 30.0  # a shared session's manifest waits this long at most for its blocks to land below


def add_serve_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2, tiny-random, or a local safetensors directory")
    p.add_argument("--served-model-name", default=None, help="the model id clients name (default: --model)")
    p.add_argument("--kv-connector", default="local://", metavar="URL",
                   help="local:///dir (embedded store), grpc://host:port (daemon) or none (default: local://)")
    p.add_argument("--config", default=None, metavar="FILE", help="TOML config, as for `tierkv serve`")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="auto: bfloat16 on CUDA and CPUs with native bfloat16 (AVX512-BF16, AMX), else float32")
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per cached block")
    p.add_argument("--tenant", default="", help="tenant whose namespace, sessions and pin cap to use")
    p.add_argument("--max-num-seqs", type=int, default=16, help="requests in the running batch at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per engine step at most")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory", default="1GiB", help="the engine's own paged KV cache (e.g. 256MiB)")
    p.add_argument("--no-enable-prefix-caching", dest="prefix_caching", action="store_false",
                   help="no prefix cache inside the engine (every reuse then comes from the KV cache service)")


def open_server_state(args: argparse.Namespace):
    """The engine (warmed up), its connector and session keeper, and the running engine loop."""
    from engine.server.app import ServerState
    from engine.server.engine_loop import EngineLoop
    from engine.server.metrics import ServerMetrics

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=args.prefix_caching,
              kv_cache_bytes=parse_size(args.kv_cache_memory, "--kv-cache-memory"))
    llm.warmup()
    try:
        client = connect(args.kv_connector, args.config)
    except TierUnavailableError as e:
        print(f"tierkv: warning: {e}; serving without the KV cache", file=sys.stderr)
        client = None
    conn = keeper = None
    if client is not None:
        ns = llm.kv_namespace(args.block_tokens, args.tenant)
        conn = EngineConnector(client, ns, llm.page_size)
        llm.set_kv_connector(conn)
        manifests = session_manifests(args.kv_connector, args.config, client)
        shared = getattr(client, "directory", None) is not None  # other nodes resume from these manifests
        keeper = SessionKeeper(client, ns, manifests, args.tenant, llm.model_id,
                               durable_timeout_s=DURABLE_TIMEOUT_S if shared else None)
    loop = EngineLoop(llm)
    metrics = ServerMetrics(lambda: loop.num_running, lambda: loop.num_waiting,
                            lambda: _connector_counters(conn), lambda: _tier_counters(client))
    return ServerState(llm, loop, metrics, args.served_model_name or args.model, keeper), conn


def _connector_counters(conn: EngineConnector | None) -> dict[str, int]:
    if conn is None:
        return {}
    s = conn.stats
    errors = s.errors + getattr(conn.client, "errors", 0)  # a daemon's client counts its own failed calls
    return {"errors": errors, "blocks_loaded": s.blocks_loaded, "blocks_saved": s.blocks_saved,
            "blocks_failed": s.blocks_failed}


def _tier_counters(client) -> dict[str, dict[str, int]]:
    try:
        return client.stats() if client is not None else {}
    except Exception:  # metrics are informational; the connector counts the cache's failures
        return {}


def run_serve_engine(args: argparse.Namespace) -> int:
    import uvicorn

    from engine.server.app import build_app

    state, conn = open_server_state(args)
    print(f"tierkv serve-engine: {state.model_name} at http://{args.host}:{args.port}/v1 "
          f"(KV cache: {args.kv_connector if conn else 'none'})", file=sys.stderr, flush=True)
    try:
        uvicorn.run(build_app(state), host=args.host, port=args.port, log_level="warning")
    finally:
        state.loop.close()
        if conn is not None:
            conn.close()
    return 0
