"""Prometheus metrics of the API server (its own registry, so several servers can coexist in tests)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("fastdeploy_requests", "Finished sequences by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("fastdeploy_prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("fastdeploy_generation_tokens", "Tokens generated", registry=r)
        self.running = Gauge("fastdeploy_num_requests_running", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("fastdeploy_num_requests_waiting", "Sequences queued for admission", registry=r)
        self.kv_usage = Gauge("fastdeploy_kv_cache_usage_ratio", "Fraction of KV blocks in use", registry=r)
        self.ttft = Histogram("fastdeploy_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("fastdeploy_inter_token_latency_seconds", "Time between consecutive token deltas",
                             buckets=_LATENCY_BUCKETS, registry=r)
