"""`tierkv generate` and `tierkv chat`: the engine answering through the KV cache."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from cache_service.config import default_cache_dir
from cache_service.sessions.manifests import Session, SessionStore
from connectors.client import connect, session_manifests
from connectors.engine import EngineConnector
from engine.llm import LLM, RequestOutput, SamplingParams
from tiers.types import TierKVError, TierUnavailableError

log = logging.getLogger("tierkv.cli")
DEFAULT_URL = "local://"


def _common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2, tiny-random, or a local safetensors directory")
    p.add_argument("--kv-connector", default=DEFAULT_URL, metavar="URL",
                   help="local:///dir (embedded store), grpc://host:port (daemon) or none (default: local://)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="auto: bfloat16 on CUDA and CPUs with native bfloat16 (AVX512-BF16, AMX), else float32")
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per cached block")
    p.add_argument("--tenant", default="", help="tenant whose namespace (and sessions) to use")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="TOML config, as for `tierkv serve`: tiers, S3 and Redis of a local:// cache and its sessions "
                        "(TIERKV_* variables and the URL's parameters override it)")


def add_generate_args(p: argparse.ArgumentParser) -> None:
    _common_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the user message")
    src.add_argument("--prompt-file", help="read the user message from this file")
    p.add_argument("--session", default=None, help="continue (or start) this named session")
    p.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_chat_args(p: argparse.ArgumentParser) -> None:
    _common_args(p)
    p.add_argument("--session", required=True, help="session to resume and extend")


class PromptFileError(TierKVError):
    """The prompt file cannot be read."""


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    try:
        return Path(args.prompt_file).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise PromptFileError(f"cannot read prompt file {args.prompt_file}: {getattr(e, 'strerror', None) or e}")


def open_engine(args: argparse.Namespace) -> tuple[LLM, EngineConnector | None]:
    """The engine with its connector attached (None when the cache is off or unreachable)."""
    llm = LLM(args.model, dtype=args.dtype)
    llm.warmup()  # one-time costs of a new process stay out of the TTFT reported
    try:
        client = connect(args.kv_connector, args.config)
    except TierUnavailableError as e:
        print(f"tierkv: warning: {e}; running without the KV cache", file=sys.stderr)
        client = None
    conn = None
    if client is not None:
        conn = EngineConnector(client, llm.kv_namespace(args.block_tokens, args.tenant), llm.page_size)
        llm.set_kv_connector(conn)
    return llm, conn


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed)


def _turn(llm: LLM, conn: EngineConnector | None, sessions: SessionStore | None, session: Session | None,
          text: str, params: SamplingParams, raw: bool = False) -> RequestOutput:
    """One user turn: build the prompt (with the session's history), generate, record."""
    messages = (session.messages if session else []) + [{"role": "user", "content": text}]
    prompt = llm.tokenizer.encode(text) if raw else llm.apply_chat_template(messages)
    out = llm.generate([prompt], params)[0]
    if sessions is not None and session is not None:
        session.messages = messages + [{"role": "assistant", "content": out.text}]
        session.token_ids = out.prompt_token_ids + out.token_ids
        session.model_id = llm.model_id
        session.namespace = conn.ns.fingerprint().hex() if conn else ""
        session.block_tokens = conn.ns.block_tokens if conn else 0  # the keys chain over the namespace's blocks
        sessions.put(session)
    return out


def _rates_path() -> Path:
    return default_cache_dir() / "prefill-rates.json"


def _recompute_estimate(llm: LLM, out: RequestOutput) -> float | None:
    """Seconds a cold prefill of this prompt would take, from the last cold
    run of this model on this machine (None before any was measured)."""
    path, key = _rates_path(), f"{llm.model_id}/{llm.kv_dtype}"
    try:
        rates = json.loads(path.read_text())
    except (OSError, ValueError):
        rates = {}
    computed = len(out.prompt_token_ids) - out.num_cached_tokens - out.num_local_cached_tokens
    if computed >= 256 and computed == len(out.prompt_token_ids):  # a cold prefill: remember its speed
        rates[key] = computed / max(out.ttft_s, 1e-6)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rates))
    rate = rates.get(key)
    return len(out.prompt_token_ids) / rate if rate else None


def _summary(llm: LLM, conn: EngineConnector | None, out: RequestOutput) -> dict:
    return {
        "text": out.text, "token_ids": out.token_ids, "prompt_tokens": len(out.prompt_token_ids),
        "cached_tokens": out.num_cached_tokens, "local_cached_tokens": out.num_local_cached_tokens,
        "ttft_s": round(out.ttft_s, 4), "total_s": round(out.total_s, 4), "finish_reason": out.finish_reason,
        "tier_hits": dict(conn.stats.tier_hits) if conn else {}, "model": llm.model_id,
        "recompute_estimate_s": _recompute_estimate(llm, out),
    }


def _print_human(s: dict) -> None:
    print(s["text"])
    hits = ", ".join(f"{k} {v}" for k, v in s["tier_hits"].items()) or "none"
    line = (f"[tierkv] prompt {s['prompt_tokens']} tokens, {s['cached_tokens']} loaded from the KV cache "
            f"(blocks per tier: {hits}); TTFT {s['ttft_s']:.3f} s, total {s['total_s']:.3f} s")
    if s["recompute_estimate_s"] is not None and s["cached_tokens"]:
        line += f"; recomputing the prompt would take ~{s['recompute_estimate_s']:.3f} s"
    print(line, file=sys.stderr)


def _session(args: argparse.Namespace, llm: LLM) -> tuple[SessionStore | None, Session | None]:
    """The session's manifest store and manifest. With a ``[directory]``
    configured (in --config, or TIERKV_DIRECTORY__URL / __CLUSTER) they are shared by every
    node on the same Redis and S3, so a session started elsewhere continues
    here; otherwise they are files next to the local store."""
    if not args.session:
        return None, None
    conn = getattr(llm, "kv_connector", None)
    sessions = session_manifests(args.kv_connector, args.config, getattr(conn, "client", None))
    return sessions, _current(sessions, args, llm)


def _current(sessions: SessionStore, args: argparse.Namespace, llm: LLM, known: Session | None = None) -> Session:
    """The session's manifest as saved now (another process may have added a turn since the last one);
    `known` (what this process has) where none is found (S3 unreadable and Redis without a copy, say)."""
    s = sessions.get(args.session, args.tenant) or known or Session(args.session, tenant=args.tenant,
                                                                   block_tokens=args.block_tokens)
    if s.model_id and s.model_id != llm.model_id:
        raise TierKVError(f"session {args.session!r} belongs to model {s.model_id}, not {llm.model_id}")
    return s


def run_generate(args: argparse.Namespace) -> int:
    text = _read_prompt(args)
    if args.raw and args.session:  # before the model loads
        raise TierKVError("--raw cannot continue a session: a session's turns go through the chat template")
    llm, conn = open_engine(args)
    try:
        sessions, session = _session(args, llm)
        out = _turn(llm, conn, sessions, session, text, _params(args), raw=args.raw)
        s = _summary(llm, conn, out)
        print(json.dumps(s)) if args.json else _print_human(s)
    finally:
        if conn is not None:
            conn.close()
    return 0


def run_chat(args: argparse.Namespace) -> int:
    llm, conn = open_engine(args)
    try:
        sessions, session = _session(args, llm)
        print(f"[tierkv] session {args.session}: {len(session.messages) // 2} earlier turns. Ctrl-D ends.",
              file=sys.stderr)
        for line in sys.stdin:
            if not line.strip():
                continue
            t = time.perf_counter()
            # as saved now (another process may have added a turn); this one's if the read finds none
            session = _current(sessions, args, llm, session) if sessions is not None else session
            out = _turn(llm, conn, sessions, session, line.strip(), _params(args))
            _print_human(_summary(llm, conn, out))
            log.info("turn took %.2fs", time.perf_counter() - t)
    finally:
        if conn is not None:
            conn.close()
    return 0
