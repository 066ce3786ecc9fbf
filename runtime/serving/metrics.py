"""The server's Prometheus metrics (`GET /metrics`), in registries of their own (one per server): the HTTP side's
(`HttpMetrics`, where the app runs) and the engine's (`Metrics`, where the model runs: the engine's process)."""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# time to first token: from a few ms (a short prompt on a tiny model) to minutes (a long one behind a queue)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class HttpMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("npumoe_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Metrics:
    def __init__(self, queue_depth: Callable[[], int], prefix_cache_bytes: Callable[[], int]) -> None:
        r = self.registry = CollectorRegistry()
        self.prompt_tokens = Counter("npumoe_prompt_tokens", "prompt tokens of served requests", registry=r)
        self.cached_tokens = Counter("npumoe_prompt_cached_tokens", "prompt tokens served from the prefix cache",
                                     registry=r)
        self.generated_tokens = Counter("npumoe_generated_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("npumoe_time_to_first_token_seconds",
                              "time to first token on the model (prefill and the first sample; queueing not "
                              "counted)", buckets=TTFT_BUCKETS, registry=r)
        self.queue_wait = Histogram("npumoe_queue_wait_seconds", "time a request waited for the model",
                                    buckets=TTFT_BUCKETS, registry=r)
        self.dropped = Counter("npumoe_dropped_assignments", "expert assignments the plan dropped (overflow: drop)",
                               registry=r)
        self.spilled = Counter("npumoe_spilled_assignments", "expert assignments spilled to cpu-exact", registry=r)
        self.static_calls = Counter("npumoe_static_calls", "static group calls", ["phase"], registry=r)
        self.cancelled = Counter("npumoe_requests_cancelled", "requests whose client left before the end",
                                 registry=r)
        self.drift_alert = Gauge("npumoe_drift_alert", "1 once the drift monitor has alerted (the traffic routes "
                                 "unlike the plan's calibration text)", registry=r)
        Gauge("npumoe_queue_depth", "requests waiting for the model", registry=r).set_function(queue_depth)
        Gauge("npumoe_prefix_cache_bytes", "bytes the prefix cache holds", registry=r).set_function(
            prefix_cache_bytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)
