"""Daemon observability: Prometheus metrics and structured log lines.

Metrics (one registry per daemon, served on ``--metrics-port``):

- ``tierkv_tier_<counter>_total{tier}``: hits, misses, evictions, corrupt,
  promoted, demoted, dropped, bypassed, deferred, lost, journal_refused, bytes_in,
  bytes_out, errors, read from ``TieredStore.stats()`` at scrape time (a custom
  collector, so the data path never touches Prometheus objects for these);
- ``tierkv_tier_{blocks,used_bytes,capacity_bytes,queue_depth,journal_blocks,journal_bytes,recovering}{tier}``
  gauges (the journal's: the S3 tier's uploads not yet done, cache_service/store/journal.py;
  recovering: 1 while the disk tier indexes again what it wrote before an unclean stop, tiers/disk_fresh.py);
- ``tierkv_rpc_seconds{method}`` latency histogram, and
  ``tierkv_rpc_total{method,tenant,code}``;
- ``tierkv_tenant_bytes_total{tenant,direction}``: payload bytes loaded/stored;
- ``tierkv_shm_attachments`` and ``tierkv_uptime_seconds``;
- ``tierkv_pinned_blocks``, ``tierkv_session_pins``, ``tierkv_session_pinned_bytes``
  gauges and ``tierkv_pins_yielded_total`` (cache_service/store/pins.py).

Logs: `StructuredFormatter` renders records as JSON lines or ``key=value``
pairs; pass fields with ``log.info("msg", extra={"fields": {...}})``.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Callable, Iterator

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_GAUGES = ("blocks", "used_bytes", "capacity_bytes", "queue_depth", "journal_blocks", "journal_bytes", "recovering")
_DAEMON_COUNTERS = ("pins_yielded",)  # of the daemon's own figures; the others are gauges
ANONYMOUS = "-"  # tenant label with auth off
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class StoreCollector(Collector):
    """Turns `stats()` (TieredStore's shape) into metric families per scrape."""

    def __init__(self, stats: Callable[[], dict[str, dict[str, int]]],
                 daemon: Callable[[], dict[str, int]] | None = None) -> None:
        self._stats, self._daemon = stats, daemon

    def collect(self) -> Iterator:
        stats = self._stats()
        keys = sorted({k for counters in stats.values() for k in counters})
        for key in keys:
            if key in _GAUGES:
                fam = GaugeMetricFamily(f"tierkv_tier_{key}", f"tier {key.replace('_', ' ')}", labels=["tier"])
            else:
                fam = CounterMetricFamily(f"tierkv_tier_{key}", f"tier {key.replace('_', ' ')}", labels=["tier"])
            for tier, counters in stats.items():
                if key in counters:
                    fam.add_metric([tier], counters[key])
            yield fam
        for key, value in (self._daemon() if self._daemon else {}).items():
            kind = CounterMetricFamily if key in _DAEMON_COUNTERS else GaugeMetricFamily
            yield kind(f"tierkv_{key}", f"daemon {key.replace('_', ' ')}", value=value)


class Metrics:
    """The daemon's registry and the instruments the RPC layer updates."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.rpc_seconds = Histogram("tierkv_rpc_seconds", "RPC latency", ["method"],
                                     buckets=_BUCKETS, registry=self.registry)
        self.rpc_total = Counter("tierkv_rpc", "RPCs by method, tenant and status code",
                                 ["method", "tenant", "code"], registry=self.registry)
        self.tenant_bytes = Counter("tierkv_tenant_bytes", "payload bytes moved per tenant",
                                    ["tenant", "direction"], registry=self.registry)
        self._http = None
        self.started = time.monotonic()

    def observe(self, method: str, tenant: str | None, code: grpc.StatusCode, seconds: float | None) -> None:
        """One call answered; `seconds` None for a call refused before it ran (not a latency)."""
        if seconds is not None:
            self.rpc_seconds.labels(method).observe(seconds)
        self.rpc_total.labels(method, tenant or ANONYMOUS, code.name).inc()

    def moved(self, tenant: str | None, direction: str, nbytes: int) -> None:
        if nbytes:
            self.tenant_bytes.labels(tenant or ANONYMOUS, direction).inc(nbytes)

    def watch_store(self, stats: Callable[[], dict[str, dict[str, int]]],
                    daemon: Callable[[], dict[str, int]] | None = None) -> None:
        self.registry.register(StoreCollector(stats, daemon))

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Start the /metrics HTTP endpoint; returns the bound port."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._http.server_port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class StructuredFormatter(logging.Formatter):
    """One line per record: JSON (``json=True``) or ``key=value`` pairs."""

    def __init__(self, json_lines: bool = False) -> None:
        super().__init__()
        self.json_lines = json_lines

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage()}
        out.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if self.json_lines:
            return json.dumps(out, default=str)
        return " ".join(f"{k}={_logfmt(v)}" for k, v in out.items())


def _logfmt(v: object) -> str:
    s = str(v)
    return json.dumps(s) if not s or any(c in s for c in ' "=\n') else s
