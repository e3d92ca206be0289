"""Prometheus metrics of the server, named after vLLM's with a `splitserve:` prefix.

Every app gets its own CollectorRegistry, so several apps (tests, embedding) never collide on the
process-global registry. Two kinds of figures:
- per-request figures (latencies, token counts, finish reasons) are observed as outputs arrive on
  the event loop, from the engine-side timestamp of the step that produced them;
- engine state (running/waiting, KV usage, prefix-cache and preemption counters) is read at scrape
  time from the counters the engine core sends with each step, never from live structures.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from splitserve.engine.async_engine import RequestStream
from splitserve.engine.messages import SchedulerStats
from splitserve.engine.output_processor import RequestOutput

FINISH_REASONS = ("stop", "length", "abort", "error")

# Latency buckets spanning a fast GPU (milliseconds) to a slow CPU (tens of seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineStateCollector(Collector):
    """Gauges and engine-owned counters, produced fresh on each scrape."""

    def __init__(self, model_name: str, stats: Callable[[], SchedulerStats]):
        self.model_name = model_name
        self.stats = stats

    def collect(self):
        s = self.stats()
        labels = ["model_name"]
        value = [self.model_name]

        def gauge(name, doc, v):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name, doc, v):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(value, v)
            return c

        yield gauge("splitserve:num_requests_running", "Sequences in the running batch.", s.num_running)
        yield gauge("splitserve:num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting)
        yield gauge("splitserve:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", s.kv_usage)
        yield counter("splitserve:prefix_cache_queries", "Tokens looked up in the prefix cache.", s.prefix_queries)
        yield counter("splitserve:prefix_cache_hits", "Tokens found in the prefix cache.", s.prefix_hits)
        yield counter("splitserve:num_requests_added", "Requests the engine took in (each finishes exactly once).",
                      s.num_received)
        yield counter("splitserve:num_preemptions", "Sequences preempted (recomputed later) for lack of KV blocks.",
                      s.num_preemptions)


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], SchedulerStats]):
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        r, ln = self.registry, ["model_name"]
        self.prompt_tokens = Counter("splitserve:prompt_tokens", "Prompt tokens processed.", ln, registry=r)
        self.generation_tokens = Counter("splitserve:generation_tokens", "Tokens generated.", ln, registry=r)
        self.request_success = Counter("splitserve:request_success", "Finished requests, by finish reason.",
                                       ln + ["finished_reason"], registry=r)
        self.ttft = Histogram("splitserve:time_to_first_token_seconds", "Time from arrival to the first token.",
                              ln, buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("splitserve:inter_token_latency_seconds", "Time between successive token deliveries.",
                             ln, buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("splitserve:e2e_request_latency_seconds", "Time from arrival to the final output.",
                             ln, buckets=_REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram("splitserve:request_queue_time_seconds", "Time from arrival to first scheduling.",
                                    ln, buckets=_REQUEST_BUCKETS, registry=r)
        self.registry.register(_EngineStateCollector(model_name, stats))
        # Touch each labelled series so the names appear (at 0) before the first request.
        for m in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e, self.queue_time):
            m.labels(model_name)
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)

    def on_output(self, stream: RequestStream, out: RequestOutput, ts: float) -> None:
        """Observes one engine output of a request; `ts` is when the engine step produced it."""
        st = stream.metrics_state
        name = self.model_name
        new_tokens = sum(len(o.delta_token_ids) for o in out.outputs)
        if new_tokens:
            if "first" not in st:
                st["first"] = ts
                self.ttft.labels(name).observe(ts - stream.arrival_time)
                self.prompt_tokens.labels(name).inc(len(out.prompt_token_ids))
                if out.queue_time is not None:
                    self.queue_time.labels(name).observe(max(0.0, out.queue_time))
            else:
                self.itl.labels(name).observe(ts - st["last"])
            st["last"] = ts
            self.generation_tokens.labels(name).inc(new_tokens)
        if out.finished:
            reasons = [o.finish_reason for o in out.outputs]
            reason = "error" if "error" in reasons else reasons[0] or "abort"
            self.request_success.labels(name, reason).inc()
            self.e2e.labels(name).observe(ts - stream.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
