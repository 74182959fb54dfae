"""`tierkv serve-engine` through the official `openai` client: an agent's
conversation with tool pauses, session hints under eviction pressure,
concurrent clients, streaming, errors and metrics.

One server for the module: SmolLM2 in float32 (answers comparable bit for
bit), no prefix cache inside the engine (every reuse comes from the KV
cache service), over an embedded store of a single 48 MiB CPU tier (~66
blocks of 16 tokens), so other traffic evicts what is not pinned.
"""
from __future__ import annotations

import collections
import json
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from engine.models import resolve_model
from tests.engine.server.agent_story import agents_under_pressure, report
from tests.engine.server.engine_server import EngineServer

pytestmark = pytest.mark.slow
MODEL = "smollm2"
BT = 16
SYSTEM = ("You are a travel-planning agent. You can call tools: weather(city) returns a forecast, "
          "flights(origin, destination, date) returns options with prices, hotels(city, nights, budget) "
          "returns rooms. Think step by step, call one tool per turn, and keep answers short. " * 3)
TOOL_RESULTS = ["weather: Lisbon, sunny, 24 C, light wind from the north-west all week",
                "flights: TP1350 08:10 EUR 129; FR7412 13:45 EUR 64; U27711 19:20 EUR 88",
                "hotels: Casa Azul EUR 95 per night; Alfama Rooms EUR 72 per night; Pensao Sol EUR 58",
                "weather: Porto, cloudy, 19 C, rain likely on Thursday afternoon"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-engine")
    (root / "tierkv.toml").write_text('[tiers.cpu]\ncapacity = "48MiB"\n')
    # the model by its directory: TIERKV_CACHE_DIR (where this server's sessions go) also holds converted models
    s = EngineServer(root / "server.log", "--model", str(resolve_model(MODEL)), "--served-model-name", MODEL,
                     "--dtype", "float32", "--kv-connector", "local://",
                     "--config", str(root / "tierkv.toml"), "--no-enable-prefix-caching", "--max-num-seqs", "8",
                     env={"TIERKV_CACHE_DIR": str(root / "cache")})
    yield s
    s.close()


def hints(session: str, **kw) -> dict:
    return {"kv_transfer_params": {"tierkv": {"session": session, **kw}}}


def ask(client: openai.OpenAI, messages: list[dict], max_tokens: int = 24, **extra):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                          extra_body=extra or None)


def noise(client: openai.OpenAI, k: int) -> None:
    """Other sessions' traffic: two unrelated long prompts (~50 blocks), unhinted."""
    for j in range(2):
        text = f"Background document {k}.{j}: " + " ".join(f"item{k}{j}{i} costs {i * 7 % 97} euros." for i in range(70))
        ask(client, [{"role": "user", "content": text}], max_tokens=2)


def test_a_hinted_agent_keeps_its_kv_through_pressure_and_an_unhinted_one_loses_it(server, capsys):
    client = server.client()
    agents = {"hinted": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": "Plan a weekend in Lisbon for two."}],
              "plain": [{"role": "system", "content": SYSTEM.replace("travel", "trip")},
                        {"role": "user", "content": "Plan a weekend in Porto for two."}]}
    # Each agent takes a turn; only the hinted one asks the cache to keep its KV over the tool pause;
    # while they wait on their tools, other sessions' traffic fills the CPU tier.
    seen = agents_under_pressure(
        lambda name, msgs: ask(client, msgs, **(hints("agent-7", retain_s=600) if name == "hinted" else {})),
        lambda turn: noise(client, turn), agents, TOOL_RESULTS, turns=5, align=BT)
    with capsys.disabled():
        print(report(seen, "serve-engine"))
    # The hinted session kept 100% of its earlier conversation every turn; the unhinted one lost it.
    assert all(c == full for c, full in seen["hinted"])
    assert all(c < full // 2 for c, full in seen["plain"])
    # The pin and the manifest are reported with the response and counted in the store.
    r = ask(client, agents["hinted"], max_tokens=4, **hints("agent-7", retain_s=600))
    session = r.model_extra["tierkv"]["session"]
    assert session["pinned_blocks"] == (r.usage.prompt_tokens + r.usage.completion_tokens - 1) // BT
    # Release lets it go: after more traffic the session's next turn is recomputed.
    r = ask(client, agents["hinted"], max_tokens=4, **hints("agent-7", release=True))
    assert r.model_extra["tierkv"]["session"]["released"] is True
    noise(client, 99)
    r = ask(client, agents["hinted"], max_tokens=4)
    assert r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens // 2


def test_concurrent_clients_get_their_own_answers(server):
    client = server.client()
    questions = [f"In one sentence, what is {x}?" for x in
                 ("a hash chain", "paged attention", "an LRU cache", "NVMe", "S3", "a Redis cluster",
                  "prefix caching", "a KV cache")]
    # Each question alone first, then all eight at once from eight client threads.
    alone = [ask(client, [{"role": "user", "content": q}], max_tokens=20).choices[0].message.content
             for q in questions]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda q: ask(server.client(), [{"role": "user", "content": q}], max_tokens=20)
                                 .choices[0].message.content, questions))
    # Batched together, every client got exactly its own single-client answer (float32).
    assert together == alone
    assert len(set(alone)) == len(alone)


def test_streaming_matches_the_whole_answer_and_reports_usage(server):
    client = server.client()
    messages = [{"role": "user", "content": "Name three capitals of Europe."}]
    whole = ask(client, messages, max_tokens=30)
    # The same request streamed: deltas, a finish reason, then a usage chunk.
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # Text completions too, with a stop string that ends the text before it.
    done = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5, 6,", max_tokens=20, temperature=0,
                                     stop=[" 9"])
    assert done.choices[0].finish_reason == "stop" and "9" not in done.choices[0].text
    assert done.choices[0].text.startswith(" 7, 8,")
    # Its usage counts the tokens up to the one that completed the stop string, not those the engine
    # made before its abort arrived.
    upto = next(m for m in range(1, 21) if " 9" in client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4, 5, 6,", max_tokens=m, temperature=0).choices[0].text)
    assert done.usage.completion_tokens == upto


def test_bad_requests_get_openai_errors_and_the_server_goes_on(server):
    client = server.client()
    hi = [{"role": "user", "content": "hi"}]
    # An unknown model is a 404; too many tokens, malformed hints and bad parameters are 400s.
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-9", messages=hi)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        ask(client, hi, max_tokens=10**6)
    with pytest.raises(openai.BadRequestError, match="retain_s"):
        ask(client, hi, **hints("agent-7", retain_s="forever"))
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=hi, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="prompt"):
        client.completions.create(model=MODEL, prompt=[10**9])
    # What the server does not do is refused, not silently ignored.
    with pytest.raises(openai.BadRequestError, match="logprobs are not supported"):
        client.chat.completions.create(model=MODEL, messages=hi, logprobs=True)
    with pytest.raises(openai.BadRequestError, match="echo is not supported"):
        client.completions.create(model=MODEL, prompt="hi", echo=True)
    with pytest.raises(openai.BadRequestError, match="best_of[a-z ]* not supported"):
        client.completions.create(model=MODEL, prompt="hi", best_of=3)
    # Sampling parameters out of their ranges, or naming tokens the model does not have, are 400s.
    for field, bad in (("frequency_penalty", {"frequency_penalty": 2.5}), ("presence_penalty", {"presence_penalty": -3}),
                       ("logit_bias", {"logit_bias": {"hello": 1}}), ("logit_bias", {"logit_bias": {"5": 101}}),
                       ("logit_bias", {"logit_bias": {"\u00b2": 1}}),  # a digit to str.isdigit, not to int(): was a 500
                       ("logit_bias", {"logit_bias": {str(10**9): 1}}),
                       ("min_tokens", {"max_tokens": 4, "extra_body": {"min_tokens": 5}}),
                       ("repetition_penalty", {"extra_body": {"repetition_penalty": 0}}),
                       ("stop_token_ids", {"extra_body": {"stop_token_ids": [10**9]}})):
        with pytest.raises(openai.BadRequestError, match=field):
            client.completions.create(model=MODEL, prompt="hi", **bad)
    # A lone UTF-16 surrogate (valid JSON, not text) is a 400 in a prompt, a message and a model name.
    for body in ({"model": MODEL, "prompt": "\ud83d"}, {"model": "\ud83d", "prompt": "hi"}):
        assert server.post_json("/v1/completions", body)[0] == 400
    assert server.post_json("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": "\ud83d"}]})[0] == 400
    # A seed past int64 and a text part that is no string are 400s too (they were 500s).
    with pytest.raises(openai.BadRequestError, match="seed"):
        client.chat.completions.create(model=MODEL, messages=hi, seed=2**64)
    with pytest.raises(openai.BadRequestError, match="must be a string"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [{"type": "text",
                                                                                             "text": 5}]}])
    # A vanishing temperature is greedy, not a failure of every request in the batch.
    tiny = client.chat.completions.create(model=MODEL, messages=hi, temperature=1e-45, max_tokens=3, seed=2**63 - 1,
                                          n=2)
    assert [c.message.content for c in tiny.choices] == [ask(client, hi, max_tokens=3).choices[0].message.content] * 2
    # The server still answers, lists its model and shows what it served in its metrics.
    assert ask(client, hi, max_tokens=3).choices[0].finish_reason in ("stop", "length")
    assert [m.id for m in client.models.list()] == [MODEL]
    metrics = server.get("/metrics")
    for name in ("tierkv_engine_time_to_first_token_seconds_count", "tierkv_engine_inter_token_latency_seconds",
                 "tierkv_engine_e2e_request_latency_seconds", "tierkv_engine_cached_tokens_total",
                 "tierkv_engine_num_requests_running", "tierkv_engine_num_requests_waiting", 'tierkv_tier_hits{tier="cpu"}'):
        assert name in metrics, name
    # Prefetch of an unknown session queues nothing; of a recorded one, what is below the top tier.
    assert json.loads(server.post("/v1/sessions/nobody/prefetch"))["queued_blocks"] == 0


def test_sampling_extensions_and_usage_per_prompt(server):
    client = server.client()
    prompt = "The capital of France is"
    greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    first = greedy.choices[0].text
    # top_k=1 samples the most likely token whatever the temperature: the greedy answer.
    hot = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.5, seed=7,
                                    extra_body={"top_k": 1})
    assert hot.choices[0].text == first
    # stop_token_ids stops at the first of them the model picks.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(resolve_model(MODEL)), local_files_only=True)
    stop_id = tok.encode(first)[1]
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                    extra_body={"stop_token_ids": [stop_id]})
    # Its text is what came before the stop token (as in vLLM); the stop token counts as generated.
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == 2
    assert cut.choices[0].text == tok.decode(tok.encode(first)[:1])
    # logit_bias: +100 on a token makes it the greedy pick at every step.
    forced = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                       logit_bias={str(stop_id): 100})
    assert forced.choices[0].text == tok.decode([stop_id] * 4)
    # EOS biased to the top ends the answer at once; min_tokens holds it back that many tokens.
    eos = {"logit_bias": {str(tok.eos_token_id): 100}}
    ends = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, **eos)
    assert ends.choices[0].finish_reason == "stop" and ends.usage.completion_tokens == 1
    late = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, **eos,
                                     extra_body={"min_tokens": 5})
    assert late.choices[0].finish_reason == "stop" and late.usage.completion_tokens == 6
    # A frequency penalty makes a greedy answer that repeats one token repeat it less.
    loop = "1 1 1 1 1 1 1 1 1 1 1 1"
    plain, penalised = (client.completions.create(model=MODEL, prompt=loop, max_tokens=16, temperature=0,
                                                  frequency_penalty=f) for f in (0, 2.0))
    most = [max(collections.Counter(tok.encode(c.choices[0].text)).values()) for c in (plain, penalised)]
    assert most[1] < most[0]
    # n choices of one prompt count its tokens once, as OpenAI and vLLM do.
    many = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, n=4)
    assert many.usage.prompt_tokens == greedy.usage.prompt_tokens
    assert many.usage.completion_tokens == 4 * 3


def test_a_client_that_leaves_stops_its_generation_and_it_is_counted(server):
    import http.client
    import socket

    def requests_total() -> float:
        return sum(float(line.split()[-1]) for line in server.get("/metrics").splitlines()
                   if line.startswith("tierkv_engine_requests_total{"))

    def running() -> float:
        return next(float(line.split()[-1]) for line in server.get("/metrics").splitlines()
                    if line.startswith("tierkv_engine_num_requests_running"))
    before = requests_total()
    for stream in (False, True):
        # A long generation, whose client goes away before it ends (a timeout, a closed tab).
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 3000, "temperature": 0,
                "ignore_eos": True, "stream": stream}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        deadline = time.monotonic() + 60
        while running() < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert running() == 1
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        # The engine stops generating for it, and the metrics count it, finished by "abort".
        deadline = time.monotonic() + 60
        while running() > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert running() == 0
    assert 'finish_reason="abort"' in server.get("/metrics") and requests_total() == before + 2
