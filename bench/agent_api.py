"""Agents through the OpenAI API (#16): `tierkv serve-engine` with session hints under eviction pressure.

A seeded multi-session, multi-turn agent conversation runs through the
official `openai` client against `tierkv serve-engine` (SmolLM2, float32, no
prefix cache inside the engine, one small CPU tier): hinted sessions pause
for tools with ``{"tierkv": {"session": ..., "retain_s": ...}}``, unhinted
ones do not, and other traffic overflows the tier during every pause.

Figures (last line, one JSON object):
- ``hinted_prefix_kept`` / ``unhinted_prefix_kept``: on resumed turns, tokens
  served from the cache over the earlier conversation (block-aligned);
- ``resume_ttft_speedup``: TTFT of a hinted session's last turn computed cold
  (the same prompt behind a nonce, so nothing matches) over its TTFT resumed;
- ``concurrent_identical``: 8 concurrent clients get their single-client answers;
- ``cached_tokens_reported_ok``: every reply's ``usage.prompt_tokens_details.cached_tokens``
  equals the tokens the store served it (its hit counter, 16 tokens a block).

    python bench/agent_api.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # the packages before bench/
from _procs import free_port, wait_port  # noqa: E402

import openai  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL, BT = "smollm2", 16
TOOLS = ["weather", "flights", "hotels", "search", "calendar", "notes"]


def start_server(root: Path, cpu: str) -> tuple[subprocess.Popen, str]:
    (root / "tierkv.toml").write_text(f'[tiers.cpu]\ncapacity = "{cpu}"\n')
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", TIERKV_CACHE_DIR=str(root / "cache"))
    from engine.models import resolve_model  # by its directory: TIERKV_CACHE_DIR also holds converted models

    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve-engine", "--model", str(resolve_model(MODEL)),
                             "--served-model-name", MODEL, "--dtype", "float32",
                             "--kv-connector", "local://", "--config", str(root / "tierkv.toml"), "--port", str(port),
                             "--no-enable-prefix-caching"], cwd=ROOT, env=env, stdout=open(root / "server.log", "w"),
                            stderr=subprocess.STDOUT)
    wait_port(port, proc, "serve-engine", timeout=300)
    return proc, f"http://127.0.0.1:{port}"


def cpu_hits(base: str) -> float:
    text = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    return next(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith('tierkv_tier_hits{tier="cpu"}'))


def system_prompt(rng: random.Random, sentences: int) -> str:
    """A shared system + tool prompt (seeded): what every session of one agent application starts with."""
    parts = [f"Tool {t}: call {t}(args) to {rng.choice(['look up', 'book', 'list', 'compare', 'check'])} "
             f"{rng.choice(['prices', 'times', 'places', 'rooms', 'notes'])} for item {rng.randrange(10**4)}."
             for t in rng.choices(TOOLS, k=sentences)]
    return "You are a planning agent. Call one tool per turn and wait for its result. " + " ".join(parts)


class Agent:
    def __init__(self, name: str, hinted: bool, system: str, rng: random.Random) -> None:
        self.name, self.hinted = name, hinted
        self.messages = [{"role": "system", "content": system},
                         {"role": "user", "content": f"Task {rng.randrange(10**6)}: plan a trip for {name}."}]
        self.last: tuple[int, int] | None = None


def turn(client: openai.OpenAI, base: str, messages: list[dict], max_tokens: int, hint: dict | None) -> dict:
    """One streamed request: TTFT, text, usage, and the store's hits during it (requests run one at a time)."""
    before, t0, ttft, text, usage = cpu_hits(base), time.perf_counter(), None, "", None
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"kv_transfer_params": {"tierkv": hint}} if hint else None)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and ttft is None:
            ttft = time.perf_counter() - t0
        text += "".join(c.delta.content or "" for c in chunk.choices)
        usage = chunk.usage or usage
    served = (cpu_hits(base) - before) * BT
    return {"ttft": ttft or time.perf_counter() - t0, "text": text, "prompt": usage.prompt_tokens,
            "completion": usage.completion_tokens, "cached": usage.prompt_tokens_details.cached_tokens,
            "served": served}


def noise(client: openai.OpenAI, base: str, k: int, n: int, words: int) -> None:
    for j in range(n):
        text = f"Document {k}.{j}: " + " ".join(f"entry{k}{j}{i} weighs {i * 7 % 89} grams." for i in range(words))
        turn(client, base, [{"role": "user", "content": text}], 1, None)


def concurrent_identical(base: str) -> bool:
    qs = [f"In one short sentence, what is {x}?" for x in ("a hash", "a page", "a cache", "a disk", "a bucket",
                                                           "a cluster", "a token", "a tier")]

    def ask(q: str) -> str:
        c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
        return c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=12,
                                         temperature=0).choices[0].message.content

    alone = [ask(q) for q in qs]
    with ThreadPoolExecutor(len(qs)) as pool:
        together = list(pool.map(ask, qs))
    return together == alone


def run(quick: bool) -> dict:
    rng = random.Random(7)
    sessions, turns, sentences = ((2, 1), 3, 40) if quick else ((4, 2), 5, 60)
    cpu = "96MiB" if quick else "256MiB"
    root = Path(tempfile.mkdtemp(prefix="agent-api-"))
    t0 = time.perf_counter()
    proc, base = start_server(root, cpu)
    print(f"server up in {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
        # Hinted sessions share their application's system prompt (sub-agents forked from one prefix);
        # the unhinted ones come from another application.
        shared = system_prompt(rng, sentences)
        agents = [Agent(f"h{i}", True, shared, rng) for i in range(sessions[0])] + \
                 [Agent(f"u{i}", False, system_prompt(rng, sentences), rng) for i in range(sessions[1])]
        kept = {True: [0, 0], False: [0, 0]}
        reported_ok, warm = True, {}
        for t in range(turns):
            for a in agents:
                hint = {"session": a.name, "retain_s": 600} if a.hinted else None
                r = turn(client, base, a.messages, rng.randrange(4, 10), hint)
                reported_ok &= r["cached"] == r["served"]
                if a.last is not None:
                    p, c = a.last
                    kept[a.hinted][0] += r["cached"]
                    kept[a.hinted][1] += (p + c - 1) // BT * BT
                    warm[a.name] = r["ttft"]
                a.last = (r["prompt"], r["completion"])
                a.messages += [{"role": "assistant", "content": r["text"]},
                               {"role": "tool", "content": f"{rng.choice(TOOLS)} result {rng.randrange(10**4)}"}]
                print(f"turn {t + 1} {a.name:>3} {'hinted' if a.hinted else 'plain ':>6}: prompt {r['prompt']:5d}, "
                      f"cached {r['cached']:5d}, store served {r['served']:5.0f}, TTFT {r['ttft']:.3f} s", flush=True)
            if t + 1 < turns:  # other traffic while the agents wait on their tools
                noise(client, base, t, 1 if quick else 3, 110 if quick else 160)
        # The last turns again, cold: a nonce in front of the system prompt so nothing matches.
        cold_ttft, warm_ttft = [], []
        for a in [a for a in agents if a.hinted][:1 if quick else 3]:
            msgs = [{"role": "system", "content": f"[{rng.randrange(10**9)}] " + a.messages[0]["content"]}] + \
                   a.messages[1:-2]
            cold_ttft.append(turn(client, base, msgs, 4, None)["ttft"])
            warm_ttft.append(warm[a.name])
        t0 = time.perf_counter()
        identical = concurrent_identical(base)
        print(f"8 clients alone, then together: {time.perf_counter() - t0:.1f} s", flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    speedup = statistics.median(cold_ttft) / statistics.median(warm_ttft)
    print(f"resumed hinted TTFT {statistics.median(warm_ttft):.3f} s, the same prompts cold "
          f"{statistics.median(cold_ttft):.3f} s")
    return {"hinted_prefix_kept": round(kept[True][0] / max(1, kept[True][1]), 4),
            "unhinted_prefix_kept": round(kept[False][0] / max(1, kept[False][1]), 4),
            "resume_ttft_speedup": round(speedup, 2), "concurrent_identical": identical,
            "cached_tokens_reported_ok": reported_ok}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 hinted + 1 plain session, 3 turns (under 60 s)")
    args = ap.parse_args()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"cpu: {cpu}, {os.cpu_count()} cpus")
    t0 = time.perf_counter()
    figures = run(args.quick)
    print(f"took {time.perf_counter() - t0:.1f} s")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
