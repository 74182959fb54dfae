"""Prometheus metrics of `tierkv serve-engine` (served at ``/metrics``).

- ``tierkv_engine_time_to_first_token_seconds``, ``..._inter_token_latency_seconds``,
  ``..._e2e_request_latency_seconds``: histograms, per request (per token for the second);
- ``tierkv_engine_{prompt,generation,cached,prefix_cache_hit}_tokens_total``: prompt tokens,
  generated tokens, prompt tokens loaded from the KV cache service, and those hit in
  the engine's own prefix cache;
- ``tierkv_engine_requests_total{finish_reason}``, ``tierkv_engine_session_hint_errors_total``;
- ``tierkv_engine_num_requests_{running,waiting}`` gauges, read at scrape time;
- ``tierkv_engine_kv_cache_{errors,blocks_loaded,blocks_saved}_total``: the connector's counters (an
  unreachable cache shows here as errors while requests go on without it);
- ``tierkv_tier_<counter>{tier}``: the cache's per-tier counters (hits, misses, ...).
"""
from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.llm import RequestOutput

_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_GAP = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


class _Callbacks(Collector):
    """Gauges read from callables at scrape time (the engine's and the cache's counters)."""

    def __init__(self, connector_stats: Callable[[], dict[str, int]],
                 tier_stats: Callable[[], dict[str, dict[str, int]]]) -> None:
        self._connector, self._tiers = connector_stats, tier_stats

    def collect(self) -> Iterator:
        for key, value in self._connector().items():
            yield GaugeMetricFamily(f"tierkv_engine_kv_cache_{key}_total", f"KV connector {key.replace('_', ' ')}",
                                    value=value)
        tiers = self._tiers()
        for key in sorted({k for c in tiers.values() for k in c}):
            fam = GaugeMetricFamily(f"tierkv_tier_{key}", f"cache tier {key.replace('_', ' ')}", labels=["tier"])
            for tier, counters in tiers.items():
                if key in counters:
                    fam.add_metric([tier], counters[key])
            yield fam


class ServerMetrics:
    """The server's registry and what request handlers record."""

    def __init__(self, running: Callable[[], int], waiting: Callable[[], int],
                 connector_stats: Callable[[], dict[str, int]] = dict,
                 tier_stats: Callable[[], dict[str, dict[str, int]]] = dict) -> None:
        r = self.registry = CollectorRegistry()
        p = "tierkv_engine_"
        self.ttft = Histogram(p + "time_to_first_token_seconds", "time to first token", buckets=_LATENCY, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "time between output tokens", buckets=_TOKEN_GAP,
                             registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "request latency", buckets=_LATENCY, registry=r)
        self.prompt = Counter(p + "prompt_tokens", "prompt tokens", registry=r)
        self.generated = Counter(p + "generation_tokens", "generated tokens", registry=r)
        self.cached = Counter(p + "cached_tokens", "prompt tokens loaded from the KV cache service", registry=r)
        self.local = Counter(p + "prefix_cache_hit_tokens", "prompt tokens hit in the engine's prefix cache",
                             registry=r)
        self.hint_errors = Counter(p + "session_hint_errors", "session hints the cache failed to apply", registry=r)
        self.requests = Counter(p + "requests", "finished requests", ["finish_reason"], registry=r)
        Gauge(p + "num_requests_running", "requests in the running batch", registry=r).set_function(running)
        Gauge(p + "num_requests_waiting", "requests queued", registry=r).set_function(waiting)
        r.register(_Callbacks(connector_stats, tier_stats))

    def finished(self, out: RequestOutput, finish_reason: str) -> None:
        """Record one finished request."""
        self.ttft.observe(out.ttft_s)
        self.e2e.observe(out.total_s)
        self.prompt.inc(len(out.prompt_token_ids))
        self.generated.inc(len(out.token_ids))
        self.cached.inc(out.num_cached_tokens)
        self.local.inc(out.num_local_cached_tokens)
        self.requests.labels(finish_reason).inc()

    def token_gap(self, seconds: float, tokens: int) -> None:
        """`tokens` more output tokens arrived `seconds` after the previous ones."""
        for _ in range(tokens):
            self.itl.observe(seconds / tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
