"""Prometheus metrics of the API server (its own registry, so several servers can coexist in tests).

With data-parallel replicas every series carries a `replica` label: the engine's gauges and
counters come from each replica, and each request's counters from the replica that served it.
"""

from __future__ import annotations

from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from fastdeploy.common.spec_decode_stats import SpecDecodeStats
from fastdeploy.engine.engine_client import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


class RequestSeries:
    """The series one request updates, bound to its replica's label where there is one."""

    def __init__(self, metrics: ServerMetrics, replica: int | None) -> None:
        pick = metrics.labelled(replica)
        self.ttft = pick(metrics.ttft)
        self.itl = pick(metrics.itl)
        self.prompt_tokens = pick(metrics.prompt_tokens)
        self.generation_tokens = pick(metrics.generation_tokens)
        self._requests = metrics.requests
        self._replica = replica

    def finished(self, reason: str) -> None:
        if self._replica is None:
            self._requests.labels(finish_reason=reason).inc()
        else:
            self._requests.labels(finish_reason=reason, replica=str(self._replica)).inc()


class ServerMetrics:
    def __init__(self, replicas: int = 1, multiprocess: bool = False) -> None:
        """`replicas` > 1: every series gets a `replica` label. `multiprocess`: one of several API
        processes of a server (`--api-server-count`, Prometheus' multiprocess mode, set up by the
        launcher before this process imported prometheus_client): /metrics sums the request
        series of all of them; the engines' series are set by one process (the gauges keep its
        latest value)."""
        self.registry = CollectorRegistry()
        self.multiprocess = multiprocess
        r = self.registry
        self.by_replica = replicas > 1
        per = ["replica"] if self.by_replica else []
        mode: Literal["mostrecent"] = "mostrecent"  # of a gauge, in multiprocess mode; ignored otherwise
        self.requests = Counter("fastdeploy_requests", "Finished sequences by finish reason",
                                ["finish_reason", *per], registry=r)
        self.prompt_tokens = Counter("fastdeploy_prompt_tokens", "Prompt tokens received", per, registry=r)
        self.generation_tokens = Counter("fastdeploy_generation_tokens", "Tokens generated", per, registry=r)
        self.running = Gauge("fastdeploy_num_requests_running", "Sequences in the running batch", per, registry=r,
                             multiprocess_mode=mode)
        self.waiting = Gauge("fastdeploy_num_requests_waiting", "Sequences queued for admission", per, registry=r,
                             multiprocess_mode=mode)
        self.kv_usage = Gauge("fastdeploy_kv_cache_usage_ratio", "Fraction of KV blocks in use", per, registry=r,
                              multiprocess_mode=mode)
        self.ttft = Histogram("fastdeploy_time_to_first_token_seconds", "Arrival to first token", per,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("fastdeploy_inter_token_latency_seconds", "Time between consecutive token deltas",
                             per, buckets=_LATENCY_BUCKETS, registry=r)
        self.spec_draft_tokens = Counter("fastdeploy_spec_decode_num_draft_tokens", "Draft tokens verified", per,
                                         registry=r)
        self.spec_accepted_tokens = Counter("fastdeploy_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                            per, registry=r)
        self.spec_acceptance_rate = Gauge("fastdeploy_spec_decode_draft_acceptance_rate",
                                          "Accepted / verified draft tokens since start", per, registry=r,
                                          multiprocess_mode=mode)
        self.spec_mean_accepted_length = Gauge("fastdeploy_spec_decode_mean_accepted_length",
                                               "Tokens emitted per sequence per verifying step since start",
                                               per, registry=r, multiprocess_mode=mode)
        # Steps of a speculating engine by how they ran (see SpecDecodeStats).
        self.spec_steps = {
            field: Counter(f"fastdeploy_spec_decode_{name}", help_text, per, registry=r)
            for field, name, help_text in (
                ("num_steps", "num_steps", "Steps run"),
                ("num_steps_ahead", "num_steps_sent_ahead", "Steps sent before the frame of the step before them"),
                ("num_steps_with_prefill", "num_steps_with_prefill", "Steps holding a prefill chunk"),
                ("num_verify_steps", "num_verify_steps", "Steps verifying drafts"))}
        self.prefix_cache_queries = Counter("fastdeploy_prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache", per, registry=r)
        self.prefix_cache_hits = Counter("fastdeploy_prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache", per, registry=r)
        self.replica_up = (Gauge("fastdeploy_replica_up", "1 while the replica serves, 0 while it is down",
                                 per, registry=r, multiprocess_mode=mode) if self.by_replica else None)
        # Counter totals already exported, per replica (None: the single engine).
        self._spec_seen: dict[int | None, SpecDecodeStats] = {}
        self._prefix_seen: dict[int | None, tuple[int, int]] = {}

    def exposition(self) -> bytes:
        """The text format of every series (of all API processes, in multiprocess mode)."""
        if not self.multiprocess:
            return generate_latest(self.registry)
        summed = CollectorRegistry()
        MultiProcessCollector(summed)
        return generate_latest(summed)

    def labelled(self, replica: int | None):
        """metric -> its series for `replica` (the metric itself without replica labels)."""
        if not self.by_replica or replica is None:
            return lambda metric: metric
        return lambda metric: metric.labels(replica=str(replica))

    def for_request(self, replica: int | None) -> RequestSeries:
        return RequestSeries(self, replica if self.by_replica else None)

    def update_engine(self, stats: EngineStats, replica: int | None = None, up: bool = True) -> None:
        """Set the engine-side series from one engine's (or replica's) report."""
        pick = self.labelled(replica)
        pick(self.running).set(stats.num_running)
        pick(self.waiting).set(stats.num_waiting)
        pick(self.kv_usage).set(stats.kv_usage)
        if self.replica_up is not None and replica is not None:
            pick(self.replica_up).set(1 if up else 0)
        queries, hits = self._prefix_seen.get(replica, (0, 0))
        pick(self.prefix_cache_queries).inc(stats.prefix_cache_queries - queries)
        pick(self.prefix_cache_hits).inc(stats.prefix_cache_hits - hits)
        self._prefix_seen[replica] = (stats.prefix_cache_queries, stats.prefix_cache_hits)
        spec = stats.spec_decode
        if spec is not None:
            seen = self._spec_seen.get(replica, SpecDecodeStats())
            pick(self.spec_draft_tokens).inc(spec.num_draft_tokens - seen.num_draft_tokens)
            pick(self.spec_accepted_tokens).inc(spec.num_accepted_draft_tokens - seen.num_accepted_draft_tokens)
            for field, counter in self.spec_steps.items():
                pick(counter).inc(getattr(spec, field) - getattr(seen, field))
            pick(self.spec_acceptance_rate).set(spec.acceptance_rate)
            pick(self.spec_mean_accepted_length).set(spec.mean_accepted_length)
            self._spec_seen[replica] = spec
