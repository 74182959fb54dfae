"""The seeded agentic trace of bench/agentic.py and its replay through an OpenAI-compatible server.

The trace scales vLLM's AgentX traffic report down to a 2-core CPU (what each
figure becomes is in `TraceShape`): sessions arrive as a Poisson process, each
runs several turns, every turn appends a tool result to the conversation,
and between turns the agent waits on its tool (log-normal pause). A share of
sessions forks a sub-agent from its parent's conversation. All sessions of the
trace belong to one agent application: they share its system + tool prompt.

Replay: one thread per session (its turns are sequential, the sessions
concurrent); every request is streamed, so TTFT and TPOT are measured at the
client, and its usage gives the cached prompt tokens.
"""
from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import dataclass, field

import openai

TOOLS = ["search", "fetch", "read_file", "run_tests", "grep", "calendar", "weather", "sql"]


@dataclass(frozen=True, slots=True)
class TraceShape:
    """AgentX (vLLM's agent traffic report) -> this machine."""

    sessions: int = 12  # many concurrent sessions -> 12 (quick: 6)
    turns: tuple[int, int] = (6, 10)  # median 43 turns per session -> 6-10
    system_tokens: int = 700  # long shared system + tool prompts -> ~700 tokens
    tool_tokens: tuple[int, int] = (120, 420)  # tool results growing 142K-token contexts -> contexts of 3-6k tokens
    output_tokens: tuple[int, int] = (24, 64)  # 444-token median outputs -> 24-64 (a 2-core CPU decodes ~30 tok/s)
    pause_median_s: float = 1.5  # tool calls of seconds to minutes -> log-normal, median 1.5 s
    pause_sigma: float = 0.6
    fork_share: float = 0.35  # sub-agents in 44% of sessions -> 35% fork a sub-agent from the parent's prefix


@dataclass(slots=True)
class Turn:
    tool_text: str
    max_tokens: int
    pause_s: float


@dataclass(slots=True)
class SessionSpec:
    sid: str
    start_s: float
    task: str
    turns: list[Turn]
    fork_after: int | None = None  # the sub-agent starts after this turn of the parent
    children: list["SessionSpec"] = field(default_factory=list)


def _text(rng: random.Random, words: int, tag: str) -> str:
    return " ".join(f"{tag}{rng.randrange(1000)}" if i % 7 == 0 else rng.choice(TOOLS + ["ok", "the", "value", "is"])
                    for i in range(words))


def system_prompt(rng: random.Random, tokens: int) -> str:
    tools = " ".join(f"Tool {t}({', '.join(rng.sample(['path', 'query', 'n', 'date', 'id'], 2))}): "
                     f"{_text(rng, 12, t[:2])}." for t in TOOLS)
    return ("You are a coding and research agent. Call exactly one tool per turn, then wait for its result. "
            + tools + " " + _text(rng, max(0, tokens // 2 - 200), "rule"))


def make_trace(shape: TraceShape, rate: float, seed: int, variant: int = 0) -> tuple[str, list[SessionSpec]]:
    """(the shared system prompt, the sessions) for sessions arriving at `rate` per second.

    One seed gives the same sessions at every rate (turn counts, lengths, pauses, forks, arrival gaps scaled
    by 1/rate), so the curve against the rate measures load, not a different trace; `variant` changes only
    the words, so what one rate left in a cache cannot serve the next."""
    rng, words = random.Random(seed), random.Random(seed * 1000 + variant)
    system, t, sessions = system_prompt(words, shape.system_tokens), 0.0, []
    for i in range(shape.sessions):
        t += rng.expovariate(1.0) / rate
        s = SessionSpec(f"s{seed}v{variant}-{i}", t, f"Task {i}: {_text(words, 30, 'req')}",
                        _turns(rng, words, shape))
        if rng.random() < shape.fork_share and len(s.turns) > 2:
            s.fork_after = rng.randrange(1, len(s.turns) - 1)
            s.children.append(SessionSpec(f"{s.sid}-sub", 0.0, f"Sub-task of {i}: {_text(words, 20, 'sub')}",
                                          _turns(rng, words, shape)[: max(2, len(s.turns) // 2)]))
        sessions.append(s)
    return system, sessions


def _turns(rng: random.Random, words: random.Random, shape: TraceShape) -> list[Turn]:
    n = rng.randint(*shape.turns)
    return [Turn(_text(words, rng.randint(*shape.tool_tokens) // 2, "out"), rng.randint(*shape.output_tokens),
                 rng.lognormvariate(math.log(shape.pause_median_s), shape.pause_sigma)) for _ in range(n)]


@dataclass(slots=True)
class Result:
    sid: str
    turn: int
    arrive_s: float
    ttft_s: float
    tpot_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ideal_tokens: int  # the earlier conversation (prompt + output of the turn before), aligned
    text: str


class Replay:
    """Replays a trace against `base_url` (model `model`), with session hints when `hints`."""

    def __init__(self, base_url: str, model: str, system: str, align: int, hints: bool) -> None:
        self.base_url, self.model, self.system, self.align, self.hints = base_url, model, system, align, hints
        self.results: list[Result] = []
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def run(self, sessions: list[SessionSpec]) -> list[Result]:
        self.t0 = time.perf_counter()
        for s in sessions:
            self._spawn(s, [{"role": "system", "content": self.system}], s.start_s)
        while self._threads:
            self._threads.pop().join()
        return sorted(self.results, key=lambda r: r.arrive_s)

    def _spawn(self, s: SessionSpec, history: list[dict], start_s: float) -> None:
        th = threading.Thread(target=self._session, args=(s, history, start_s), daemon=True)
        with self._lock:
            self._threads.append(th)
        th.start()

    def _session(self, s: SessionSpec, history: list[dict], start_s: float) -> None:
        client = openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0, timeout=900)
        time.sleep(max(0.0, start_s - (time.perf_counter() - self.t0)))
        messages, prev = history + [{"role": "user", "content": s.task}], None
        for k, turn in enumerate(s.turns):
            last = k == len(s.turns) - 1
            prev = self._request(client, s.sid, k, messages, turn.max_tokens, prev, last)
            messages += [{"role": "assistant", "content": prev.text}, {"role": "tool", "content": turn.tool_text}]
            if s.fork_after == k:  # the sub-agent starts from everything its parent has said so far
                for child in s.children:
                    self._spawn(child, list(messages), time.perf_counter() - self.t0)
            if not last:
                time.sleep(turn.pause_s)

    def _request(self, client: openai.OpenAI, sid: str, k: int, messages: list[dict], max_tokens: int,
                 prev: Result | None, last: bool) -> Result:
        hint = {"session": sid, "release": True} if last else {"session": sid, "retain_s": 300}
        extra = {"kv_transfer_params": {"tierkv": hint}} if self.hints else None
        arrive = time.perf_counter()
        first = end = None
        text, usage, n = "", None, 0
        stream = client.chat.completions.create(model=self.model, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True, extra_body=extra,
                                                stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                end, n = time.perf_counter(), n + 1
                text += chunk.choices[0].delta.content
            usage = chunk.usage or usage
        first = first or time.perf_counter()
        ideal = 0 if prev is None else (prev.prompt_tokens + prev.completion_tokens - 1) // self.align * self.align
        details = usage.prompt_tokens_details
        r = Result(sid, k, arrive - self.t0, first - arrive, ((end or first) - first) / max(1, n - 1),
                   usage.prompt_tokens, usage.completion_tokens, details.cached_tokens if details else 0, ideal, text)
        with self._lock:
            self.results.append(r)
        return r
