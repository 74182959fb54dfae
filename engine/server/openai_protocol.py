"""The OpenAI API's request and response shapes, as `tierkv serve-engine` speaks them.

Requests are pydantic models (unknown fields are ignored, as OpenAI's
clients send fields servers may not know; a known field this server cannot
honour is refused with a 400 when set to anything but its no-op value, never
silently ignored); responses are built as plain dicts in the API's
documented shape. Errors use OpenAI's error body.
"""
from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# known fields this server does not implement -> their no-op values (vLLM's extensions among them)
UNSUPPORTED = {"suffix": ("",), "tools": ([],), "response_format": ({"type": "text"},), "cache_salt": ("",)}
LOGIT_BIAS_MAX = 1024  # entries of one request's logit_bias


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=16)
    ignore_eos: bool = False  # vLLM's extension, for benchmarks
    top_k: int | None = Field(None, ge=-1)  # vLLM's extension: -1 or 0 is off
    stop_token_ids: list[int] | None = Field(None, max_length=64)  # vLLM's extension
    best_of: int | None = Field(None, ge=1)
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's field; our session hints live under "tierkv"
    logprobs: bool | int | None = None  # not supported: refused rather than silently ignored
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)  # vLLM's extension
    logit_bias: dict[str, float] | None = Field(None, max_length=LOGIT_BIAS_MAX)  # token id (as a string) -> bias
    min_tokens: int | None = Field(None, ge=0)  # vLLM's extension

    @field_validator("logit_bias")
    @classmethod
    def _biases(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (v or {}).items():
            if not re.fullmatch(r"[0-9]{1,10}", token):
                raise ValueError(f"logit_bias keys must be token ids, got {token!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, noop in UNSUPPORTED.items():
                if data.get(name) is not None and data[name] not in noop:
                    raise ValueError(f"{name} is not supported by this server")
            if _lone_surrogate(data):  # valid JSON ("\ud83d"), not text: the tokenizer raised on it
                raise ValueError("strings must be valid Unicode (a lone UTF-16 surrogate was sent)")
        return data

    @model_validator(mode="after")
    def _one_of_each(self) -> "_Common":
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported by this server")
        return self

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | int | None) -> None:
        if v:
            raise ValueError("logprobs are not supported by this server")
        return None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_calls, name, ... pass through to the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def as_template_message(self) -> dict[str, Any]:
        """The message as the chat template takes it (content parts joined into text)."""
        msg = self.model_dump(exclude_none=True)
        content = self.content
        if isinstance(content, list):
            texts = [p.get("text", "") for p in content if p.get("type") == "text"]
            if len(texts) != len(content):
                raise ValueError("only text content parts are supported")
            if not all(isinstance(t, str) for t in texts):
                raise ValueError("a text content part's text must be a string")
            content = "".join(texts)
        msg["content"] = content or ""
        return msg


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported by this server")
        return v

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt is empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


def _lone_surrogate(v: Any) -> bool:
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(v, dict):
        return any(_lone_surrogate(k) or _lone_surrogate(x) for k, x in v.items())
    # a list of token ids is walked no further than its first element (a 4M-id prompt: 0.5 s of the loop)
    return isinstance(v, list) and bool(v) and not isinstance(v[0], int) and any(_lone_surrogate(x) for x in v)


def error_body(message: str, type_: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """`usage`, with ``prompt_tokens_details.cached_tokens`` (prompt tokens not computed: from the KV cache
    service or the engine's own prefix cache, as vLLM reports it)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def envelope(kind: str, rid: str, model: str, choices: list[dict], usage_: dict | None = None,
             extra: dict | None = None) -> dict[str, Any]:
    """A response or stream chunk: object `kind` ("chat.completion", "text_completion", ...)."""
    body = {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    body.update(extra or {})
    return body


def chat_choice(index: int, text: str | None, finish_reason: str | None, delta: bool = False,
                first: bool = False) -> dict[str, Any]:
    if delta:
        d = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        return {"index": index, "delta": d, "logprobs": None, "finish_reason": finish_reason}
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish_reason}


def text_choice(index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
