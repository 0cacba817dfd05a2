"""Prometheus metrics of the API server (its own registry, so several servers can coexist in tests)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fastdeploy.spec_decode.stats import SpecDecodeStats

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
        self.spec_draft_tokens = Counter("fastdeploy_spec_decode_num_draft_tokens", "Draft tokens verified",
                                         registry=r)
        self.spec_accepted_tokens = Counter("fastdeploy_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                            registry=r)
        self.spec_acceptance_rate = Gauge("fastdeploy_spec_decode_draft_acceptance_rate",
                                          "Accepted / verified draft tokens since start", registry=r)
        self.spec_mean_accepted_length = Gauge("fastdeploy_spec_decode_mean_accepted_length",
                                               "Tokens emitted per sequence per verifying step since start",
                                               registry=r)
        self._spec_seen = SpecDecodeStats()
        self.prefix_cache_queries = Counter("fastdeploy_prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_cache_hits = Counter("fastdeploy_prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache", registry=r)
        self._prefix_seen = (0, 0)
        self.itl = Histogram("fastdeploy_inter_token_latency_seconds", "Time between consecutive token deltas",
                             buckets=_LATENCY_BUCKETS, registry=r)

    def update_prefix_cache(self, queries: int, hits: int) -> None:
        """Bring the counters up to the engine's totals (tokens since start)."""
        self.prefix_cache_queries.inc(queries - self._prefix_seen[0])
        self.prefix_cache_hits.inc(hits - self._prefix_seen[1])
        self._prefix_seen = (queries, hits)

    def update_spec_decode(self, stats: SpecDecodeStats | None) -> None:
        """Bring the counters up to the engine's running totals."""
        if stats is None:
            return
        self.spec_draft_tokens.inc(stats.num_draft_tokens - self._spec_seen.num_draft_tokens)
        self.spec_accepted_tokens.inc(stats.num_accepted_draft_tokens - self._spec_seen.num_accepted_draft_tokens)
        self.spec_acceptance_rate.set(stats.acceptance_rate)
        self.spec_mean_accepted_length.set(stats.mean_accepted_length)
        self._spec_seen = stats
