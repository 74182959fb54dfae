"""The HTTP routes of `tierkv serve-engine` (FastAPI): OpenAI's chat and text
completions (streamed as server-sent events or not), models, health,
Prometheus metrics, and the session endpoints of our session hints.

Every request is validated here (400 with OpenAI's error body), run through
the shared engine loop (continuous batching with every other request), and
its session hints applied once it finished, before the response's end: a
client that sends its next turn after reading this one finds the pin in place.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from connectors.session_hints import HintError, SessionHint, SessionKeeper
from engine.errors import PromptError
from engine.llm import LLM
from engine.sequence import SamplingParams
from engine.server.engine_loop import EngineLoop
from engine.server.generation import Delta, EngineFailed, Generation
from engine.server.metrics import ServerMetrics
from engine.server import openai_protocol as api

log = logging.getLogger("tierkv.serve_engine")


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


@dataclass(slots=True)
class ServerState:
    """What the routes share: the engine, its loop, metrics, and the session keeper (None: no cache)."""

    llm: LLM
    loop: EngineLoop
    metrics: ServerMetrics
    model_name: str
    keeper: SessionKeeper | None = None


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI application over a running engine loop."""
    app = FastAPI(title="tierkv serve-engine")
    _errors(app)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.loop.alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "tierkv", "max_model_len": state.llm.max_model_len}]}

    # Tokenizing runs off the event loop: a 4M-token prompt held every other client's stream for 12 s.
    @app.post("/v1/chat/completions")
    async def chat(body: api.ChatCompletionRequest, request: Request) -> Response:
        messages = [_template_message(m) for m in body.messages]
        ids = await asyncio.to_thread(state.llm.apply_chat_template, messages)
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await _complete(state, request, body, [ids], max_tokens, "chat.completion", "chatcmpl", messages)

    @app.post("/v1/completions")
    async def completions(body: api.CompletionRequest, request: Request) -> Response:
        prompts = [await asyncio.to_thread(_prompt_ids, state.llm, p) for p in body.prompts()]
        return await _complete(state, request, body, prompts, body.max_tokens or 16, "text_completion", "cmpl", None)

    @app.post("/v1/sessions/{session_id}/prefetch")
    async def prefetch(session_id: str) -> dict:
        hint = _hint(state, {"tierkv": {"session": session_id, "prefetch": True}})
        queued = await asyncio.to_thread(state.keeper.prefetch, hint.session) if state.keeper else 0
        return {"session": session_id, "queued_blocks": queued}

    @app.post("/v1/sessions/{session_id}/release")
    async def release(session_id: str) -> dict:
        hint = _hint(state, {"tierkv": {"session": session_id, "release": True}})
        return {"session": session_id, **(await _apply_hint(state, hint, [], None))}

    return app


async def _complete(state: ServerState, request: Request, body: api._Common, prompts: list[list[int]],
                    max_tokens: int | None, kind: str, id_prefix: str, messages: list[dict] | None) -> Response:
    if body.model != state.model_name:
        raise BadRequest(f"The model `{body.model}` does not exist.", 404, "model_not_found", "model")
    hint = _hint(state, body.kv_transfer_params)
    params = [_sampling(state.llm, body, len(ids), max_tokens, seed_offset=k)
              for ids in prompts for k in range(body.n)]
    gen = Generation(state.loop, state.metrics, state.llm.tokenizer, [ids for ids in prompts for _ in range(body.n)],
                     params, body.stop)
    if hint is not None and hint.prefetch and state.keeper is not None:  # in the background: the request goes on
        asyncio.get_running_loop().run_in_executor(None, _prefetch, state, hint.session)
    rid = api.new_id(id_prefix)
    if body.stream:
        return StreamingResponse(_sse(state, gen, body, kind, rid, hint, messages), media_type="text/event-stream")
    texts = [""] * len(params)
    reasons: list[str | None] = [None] * len(params)

    async def collect() -> None:
        async for d in gen.deltas():
            texts[d.index] += d.text
            reasons[d.index] = d.finish_reason or reasons[d.index]
    try:
        if not await _unless_gone(request, collect()):
            return Response(status_code=499)  # nobody reads it: the engine stopped at the client's leaving
    except EngineFailed as e:
        raise BadRequest(str(e), 500, "engine_error") from None
    extra = await _finish(state, gen, hint, messages, texts)
    choose = api.chat_choice if kind == "chat.completion" else api.text_choice
    choices = [choose(i, t, r) for i, (t, r) in enumerate(zip(texts, reasons))]
    return JSONResponse(api.envelope(kind, rid, state.model_name, choices, _usage(gen, body.n), extra))


async def _unless_gone(request: Request, work) -> bool:
    """Run `work` unless the client disconnects first (then it is cancelled, which aborts its
    sequences): Starlette cancels a streamed response's generator, not a handler, and a client
    that timed out (and retried) had each of its requests generate to the end for nobody."""
    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)  # the work's abort runs before we answer, or go
    if task.cancelled():
        return False
    task.result()  # its exception, if any
    return True


async def _sse(state: ServerState, gen: Generation, body: api._Common, kind: str, rid: str,
               hint: SessionHint | None, messages: list[dict] | None) -> AsyncIterator[str]:
    chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else kind
    chat = kind == "chat.completion"
    started: set[int] = set()
    texts = [""] * len(gen.outputs)

    def chunk(d: Delta) -> str:
        first = d.index not in started
        started.add(d.index)
        texts[d.index] += d.text
        choice = (api.chat_choice(d.index, d.text, d.finish_reason, delta=True, first=first) if chat
                  else api.text_choice(d.index, d.text, d.finish_reason))
        return _event(api.envelope(chunk_kind, rid, state.model_name, [choice]))

    try:
        async for d in gen.deltas():
            yield chunk(d)
    except EngineFailed as e:
        yield _event(api.error_body(str(e), "server_error", "engine_error"))
        return
    extra = await _finish(state, gen, hint, messages, texts)
    if body.include_usage:
        yield _event(api.envelope(chunk_kind, rid, state.model_name, [], _usage(gen, body.n), extra))
    yield "data: [DONE]\n\n"


async def _finish(state: ServerState, gen: Generation, hint: SessionHint | None, messages: list[dict] | None,
                  texts: list[str]) -> dict:
    """Apply the session hint to the first choice's conversation; our extra response fields."""
    out = gen.outputs[0]
    extra = {"tierkv": {"kv_cache_tokens": sum(o.num_cached_tokens for o in gen.outputs),
                        "prefix_cache_tokens": sum(o.num_local_cached_tokens for o in gen.outputs)}}
    if hint is not None:
        tokens = out.prompt_token_ids + out.token_ids[:-1]  # the last token has no KV yet
        convo = messages + [{"role": "assistant", "content": texts[0]}] if messages is not None else None
        extra["tierkv"]["session"] = await _apply_hint(state, hint, tokens, convo)
    return extra


async def _apply_hint(state: ServerState, hint: SessionHint, tokens: list[int], messages: list[dict] | None) -> dict:
    if state.keeper is None:
        return {"ignored": "no KV cache"}
    try:
        return await asyncio.to_thread(state.keeper.finished, hint, tokens, messages)
    except Exception as e:  # dispatch boundary: an unusable cache costs the pin, never the response
        log.exception("session %s: applying hints failed", hint.session)
        state.metrics.hint_errors.inc()
        return {"error": str(e)}


def _prefetch(state: ServerState, session: str) -> None:
    try:
        state.keeper.prefetch(session)
    except Exception:  # dispatch boundary: a prefetch the cache cannot do costs the prefetch only
        log.exception("session %s: prefetch failed", session)
        state.metrics.hint_errors.inc()


def _usage(gen: Generation, n: int) -> dict:
    """Prompt tokens count once per prompt, not per choice (as OpenAI and vLLM count them)."""
    outs, prompts = gen.outputs, gen.outputs[::n]
    cached = sum(o.num_cached_tokens + o.num_local_cached_tokens for o in prompts)
    made = sum(gen.completion_tokens(i) for i in range(len(outs)))
    return api.usage(sum(len(o.prompt_token_ids) for o in prompts), made, cached)


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _hint(state: ServerState, params: dict | None) -> SessionHint | None:
    try:
        return SessionHint.from_params(params)
    except HintError as e:
        raise BadRequest(str(e), param="kv_transfer_params") from None


def _template_message(m: api.ChatMessage) -> dict[str, Any]:
    try:
        return m.as_template_message()
    except ValueError as e:
        raise BadRequest(str(e), param="messages") from None


def _prompt_ids(llm: LLM, prompt: str | list[int]) -> list[int]:
    try:
        return llm.prompt_ids(prompt)
    except PromptError as e:
        raise BadRequest(str(e), param="prompt") from None


def _sampling(llm: LLM, body: api._Common, prompt_len: int, max_tokens: int | None, seed_offset: int
              ) -> SamplingParams:
    room = llm.max_model_len - prompt_len
    if room < 1 or (max_tokens is not None and max_tokens > room):
        raise BadRequest(f"This model's maximum context length is {llm.max_model_len} tokens. However, you requested "
                         f"{prompt_len + (max_tokens or 1)} tokens ({prompt_len} in the messages, {max_tokens or 1} "
                         f"in the completion).", code="context_length_exceeded", param="max_tokens")
    seed = None if body.seed is None else (body.seed + seed_offset) % 2**64  # choice k of n: seed + k, as a u64
    if body.min_tokens and body.min_tokens > (max_tokens or room):
        raise BadRequest(f"min_tokens ({body.min_tokens}) must not exceed max_tokens ({max_tokens or room})",
                         param="min_tokens")
    vocab = llm.model_config.vocab_size
    for name, ids in (("stop_token_ids", body.stop_token_ids or ()), ("logit_bias", map(int, body.logit_bias or {}))):
        if any(not 0 <= t < vocab for t in ids):
            raise BadRequest(f"{name} must hold token ids in [0, {vocab})", param=name)
    return SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                          top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
                          max_tokens=max_tokens or room, seed=seed, ignore_eos=body.ignore_eos,
                          stop_token_ids=tuple(body.stop_token_ids or ()), min_tokens=body.min_tokens or 0,
                          presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
                          repetition_penalty=body.repetition_penalty or 1.0,
                          logit_bias={int(t): b for t, b in (body.logit_bias or {}).items()})


def _errors(app: FastAPI) -> None:
    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, e: BadRequest) -> JSONResponse:
        type_ = "invalid_request_error" if e.status < 500 else "server_error"
        return JSONResponse(api.error_body(str(e), type_, e.code, e.param), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        msg = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return JSONResponse(api.error_body(msg, param=where), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        return JSONResponse(api.error_body(str(e.detail)), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def failed(request: Request, e: Exception) -> JSONResponse:  # OpenAI's body, not a plain-text 500
        log.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(api.error_body(f"internal error: {type(e).__name__}", "server_error"), status_code=500)
