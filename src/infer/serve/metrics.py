"""`GET /metrics`: Prometheus text from a registry of the server's own (one per app).

Counters and histograms are measured at the HTTP layer (what a client sees); the
engine's gauges (running, waiting, batch size, ...) are read from `Engine.stats()` at
scrape time.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# Engine.stats() keys shown under a fixed name (the rest as infer_engine_<key>).
_NAMED = {
    "running": ("infer_requests_running", "requests being generated (rows in the batch)"),
    "waiting": ("infer_requests_waiting", "requests queued for a row"),
    "batch_size": ("infer_batch_size", "rows in the engine's last step"),
}


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        seen = set()
        for key, (name, doc) in _NAMED.items():
            seen.add(name)
            yield GaugeMetricFamily(name, doc, value=float(stats.get(key, 0)))
        for key, value in sorted(stats.items()):
            if key in _NAMED or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            name = "infer_engine_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
            if name not in seen:
                seen.add(name)
                yield GaugeMetricFamily(name, f"Engine.stats()[{key!r}]", value=float(value))


class Metrics:
    """The server's metrics; `render()` is the body of ``GET /metrics``."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "infer_requests",
            "requests answered, by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter("infer_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("infer_generation_tokens", "tokens generated", registry=r)
        self.in_flight = Gauge("infer_http_requests_in_flight", "generation requests open", registry=r)
        self.ttft = Histogram(
            "infer_time_to_first_token_seconds",
            "from a request's arrival to its first token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "infer_inter_token_latency_seconds",
            "between consecutive tokens of a request (a burst of n tokens counts n gaps of 1/n)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "infer_request_duration_seconds",
            "from arrival to the last token",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        r.register(_EngineCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["Metrics"]
