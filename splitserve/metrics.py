"""Prometheus metrics of the server, named after vLLM's with a `splitserve:` prefix.

Every app gets its own CollectorRegistry, so several apps (tests, embedding) never collide on the
process-global registry. Three kinds of figures:
- per-request figures (latencies, token counts, finish reasons, phases: queue, prefill, decode) are
  observed as outputs arrive on the event loop, from the engine-side timestamp of the step that
  produced them;
- per-step figures (tokens run by each engine step) arrive with the core's step messages;
- engine state (running/waiting, KV usage, prefix-cache and preemption counters) is read at scrape
  time from the counters the engine core sends with each step, never from live structures.
Request accounting has one rule: a request is added when the server hands it to the engine
(`on_request_added`), and leaves through exactly one finish reason: stop, length, abort or error once
its stream ends (`on_output`), or "rejected" when the engine refuses it at the door (overloaded,
shutting down, input only the engine checks). The unit is the engine request: one prompt with all of
its n samples. So `num_requests_added_total` always equals the sum of `request_success_total` over
the reasons, plus the requests still in flight.
With `--metrics-compat vllm` every family is also answered under its `vllm:` name (and the older
vLLM names of the KV-usage gauge and the per-token latency), so existing dashboards work.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from splitserve.engine.async_engine import RequestStream
from splitserve.protocol.core_messages import SchedulerStats
from splitserve.engine.output_processor import RequestOutput
from splitserve.kv_transfer.base import TRANSFER_TIME_BUCKETS

logger = logging.getLogger(__name__)

PREFIX = "splitserve:"
FINISH_REASONS = ("stop", "length", "abort", "error", "rejected")

# Latency buckets spanning a fast GPU (milliseconds) to a slow CPU (tens of seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)
# vLLM's older names of two families, answered too under --metrics-compat vllm.
_VLLM_ALIASES = {"kv_cache_usage_perc": ("gpu_cache_usage_perc",),
                 "inter_token_latency_seconds": ("time_per_output_token_seconds",)}


def _token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to the context length (vLLM's buckets for token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(m * scale)
        scale *= 10


def _one(kind, labels, value, name, doc, v):
    f = kind(name, doc, labels=labels)
    f.add_metric(value, v)
    return f


class _EngineStateCollector(Collector):
    """Gauges and engine-owned counters, produced fresh on each scrape. With several engine cores
    (data-parallel replicas) each sample carries an `engine` label: one per replica ("0", "1", ...)
    and "all" for the server's totals."""

    def __init__(self, model_name: str, stats: Callable[[], SchedulerStats],
                 replica_stats: Callable[[], list[SchedulerStats]] | None = None):
        self.model_name = model_name
        self.stats = stats
        self.replica_stats = replica_stats

    def collect(self):
        per_replica = self.replica_stats() if self.replica_stats is not None else []
        if len(per_replica) > 1:
            labels = ["model_name", "engine"]
            series = [([self.model_name, str(i)], s) for i, s in enumerate(per_replica)]
            series.append(([self.model_name, "all"], self.stats()))
        else:
            labels = ["model_name"]
            series = [([self.model_name], self.stats())]

        def family(kind, name, doc, field):
            f = kind(name, doc, labels=labels)
            for value, s in series:
                f.add_metric(value, getattr(s, field))
            return f

        g, c = GaugeMetricFamily, CounterMetricFamily
        yield family(g, "splitserve:num_requests_running", "Sequences in the running batch.", "num_running")
        yield family(g, "splitserve:num_requests_waiting", "Sequences waiting to be scheduled.", "num_waiting")
        yield family(g, "splitserve:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", "kv_usage")
        yield family(c, "splitserve:prefix_cache_queries", "Tokens looked up in the prefix cache.", "prefix_queries")
        yield family(c, "splitserve:prefix_cache_hits", "Tokens found in the prefix cache.", "prefix_hits")
        yield family(c, "splitserve:num_preemptions", "Sequences preempted (recomputed later) for lack of KV blocks.",
                     "num_preemptions")
        yield family(c, "splitserve:prompt_tokens_computed", "Prompt tokens the engine's steps computed (neither "
                     "found in the prefix cache nor loaded from another engine).", "prompt_tokens_computed")
        value, s = series[-1]  # the speculation and transfer figures: the server's (one engine's, or the totals)
        if s.spec_accepted_per_pos:  # speculative decoding is on (vLLM's spec_decode families)
            yield _one(CounterMetricFamily, labels, value, "splitserve:spec_decode_num_drafts", "Sequence steps that verified draft tokens.",
                          s.spec_num_drafts)
            yield _one(CounterMetricFamily, labels, value, "splitserve:spec_decode_num_draft_tokens", "Draft tokens verified.",
                          s.spec_num_draft_tokens)
            yield _one(CounterMetricFamily, labels, value, "splitserve:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                          s.spec_num_accepted_tokens)
            per_pos = CounterMetricFamily("splitserve:spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted, by position in the draft (0: the first).",
                                          labels=labels + ["position"])
            for pos, n in enumerate(s.spec_accepted_per_pos):
                per_pos.add_metric(value + [str(pos)], n)
            yield per_pos
        t = s.kv_transfer
        if t is None:
            return
        yield _one(GaugeMetricFamily, labels, value, "splitserve:kv_transfer_receiving", "Sequences waiting for their prompt's KV from another "
                    "engine.", s.num_receiving)
        yield _one(GaugeMetricFamily, labels, value, "splitserve:kv_transfer_held_requests", "Finished requests whose KV blocks are held for a "
                    "remote reader.", s.num_held)
        for name, doc, v in (("sent_tokens", "Prompt tokens whose KV was sent to other engines.", t.sent_tokens),
                             ("sent_bytes", "KV bytes sent to other engines.", t.sent_bytes),
                             ("received_tokens", "Prompt tokens whose KV was loaded from other engines.", t.recv_tokens),
                             ("received_bytes", "KV bytes loaded from other engines.", t.recv_bytes),
                             ("failed", "KV loads that failed (recomputed or failed by policy).", t.failed),
                             ("offload_saved_blocks", "Evicted prefix blocks copied to host memory.",
                              t.offload_saved_blocks),
                             ("offload_hit_tokens", "Prefix tokens brought back from host memory.", t.offload_hit_tokens)):
            yield _one(CounterMetricFamily, labels, value, f"splitserve:kv_transfer_{name}", doc, v)
        h = HistogramMetricFamily("splitserve:kv_transfer_time_seconds", "Time of each KV load from another "
                                  "engine (handshake, read, acknowledgement).", labels=labels)
        running, buckets = 0, []
        for le, n in zip([*map(str, TRANSFER_TIME_BUCKETS), "+Inf"], t.time_buckets):
            running += n
            buckets.append((le, running))
        h.add_metric(value, buckets, t.time_sum)
        yield h


class _Renamed(Collector):
    """Every `splitserve:` family of another registry again, under the `vllm:` prefix (and the
    aliases above). A collector of its own registry: registered with the source, it would collect itself."""

    def __init__(self, source: CollectorRegistry, new_prefix: str = "vllm:"):
        self.source = source
        self.new_prefix = new_prefix

    def collect(self):
        for family in self.source.collect():
            if not family.name.startswith(PREFIX):
                continue
            base = family.name[len(PREFIX):]
            for name in (base, *_VLLM_ALIASES.get(base, ())):
                copy = Metric(self.new_prefix + name, family.documentation, family.type, family.unit)
                copy.samples = [s._replace(name=self.new_prefix + name + s.name[len(family.name):])
                                for s in family.samples]
                yield copy


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], SchedulerStats], max_model_len: int = 2048,
                 cache_info: dict[str, str] | None = None, compat: str | None = None,
                 replica_stats: Callable[[], list[SchedulerStats]] | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        r, ln = self.registry, ["model_name"]
        self.prompt_tokens = Counter("splitserve:prompt_tokens", "Prompt tokens processed.", ln, registry=r)
        self.generation_tokens = Counter("splitserve:generation_tokens", "Tokens generated.", ln, registry=r)
        self.requests_added = Counter("splitserve:num_requests_added",
                                      "Requests handed to the engine (each finishes exactly once).", ln, registry=r)
        self.request_success = Counter("splitserve:request_success", "Finished requests, by finish reason "
                                       "(rejected: refused by the engine when added).",
                                       ln + ["finished_reason"], registry=r)
        self.lora_requests = Counter("splitserve:lora_requests", "Requests that selected a LoRA adapter, by adapter.",
                                     ln + ["lora_name"], registry=r)
        self.ttft = Histogram("splitserve:time_to_first_token_seconds", "Time from arrival to the first token.",
                              ln, buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("splitserve:inter_token_latency_seconds", "Time between successive token deliveries.",
                             ln, buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("splitserve:e2e_request_latency_seconds", "Time from arrival to the final output.",
                             ln, buckets=_REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram("splitserve:request_queue_time_seconds", "Time from arrival to first scheduling.",
                                    ln, buckets=_REQUEST_BUCKETS, registry=r)
        self.prefill_time = Histogram("splitserve:request_prefill_time_seconds",
                                      "Time from first scheduling to the first token.", ln, buckets=_REQUEST_BUCKETS,
                                      registry=r)
        self.decode_time = Histogram("splitserve:request_decode_time_seconds",
                                     "Time from the first token to the last.", ln, buckets=_REQUEST_BUCKETS, registry=r)
        self.inference_time = Histogram("splitserve:request_inference_time_seconds",
                                        "Time from first scheduling to the last token (prefill + decode).", ln,
                                        buckets=_REQUEST_BUCKETS, registry=r)
        token_buckets = _token_buckets(max_model_len)
        self.request_prompt_tokens = Histogram("splitserve:request_prompt_tokens", "Prompt tokens per request.",
                                               ln, buckets=token_buckets, registry=r)
        self.request_generation_tokens = Histogram("splitserve:request_generation_tokens",
                                                   "Generated tokens per request (all n samples).", ln,
                                                   buckets=token_buckets, registry=r)
        self.params_n = Histogram("splitserve:request_params_n", "The n (parallel samples) of each request.", ln,
                                  buckets=_N_BUCKETS, registry=r)
        self.iteration_tokens = Histogram("splitserve:iteration_tokens_total", "Tokens run by each engine step.",
                                          ln, buckets=_ITERATION_TOKEN_BUCKETS, registry=r)
        self.registry.register(_EngineStateCollector(model_name, stats, replica_stats))
        if cache_info is not None:
            info = Gauge("splitserve:cache_config_info", "The KV cache's configuration (the labels; the value is 1).",
                         sorted(cache_info), registry=r)
            info.labels(**cache_info).set(1)
        # Touch each labelled series so the names appear (at 0) before the first request.
        for m in (self.requests_added, self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e,
                  self.queue_time, self.prefill_time, self.decode_time, self.inference_time, self.request_prompt_tokens,
                  self.request_generation_tokens, self.params_n, self.iteration_tokens):
            m.labels(model_name)
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)
        self.compat_registry = None
        if compat == "vllm":
            self.compat_registry = CollectorRegistry(auto_describe=True)
            self.compat_registry.register(_Renamed(self.registry))
        # Plain running totals for the periodic stats line (cheaper than reading the collectors).
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0

    def on_request_added(self) -> None:
        self.requests_added.labels(self.model_name).inc()

    def on_request_rejected(self) -> None:
        """The engine refused a request on_request_added counted: it ends here, with no stream."""
        self._finished("rejected")

    def _finished(self, reason: str) -> None:
        self.request_success.labels(self.model_name, reason).inc()

    def on_output(self, stream: RequestStream, out: RequestOutput, ts: float) -> None:
        """Observes one engine output of a request; `ts` is when the engine step produced it."""
        st = stream.metrics_state
        name = self.model_name
        new_tokens = sum(len(o.delta_token_ids) for o in out.outputs)
        if out.queue_time is not None and "scheduled" not in st:
            st["scheduled"] = stream.arrival_time + max(0.0, out.queue_time)
        if new_tokens:
            if "first" not in st:
                st["first"] = ts
                self.ttft.labels(name).observe(ts - stream.arrival_time)
                self.prompt_tokens.labels(name).inc(len(out.prompt_token_ids))
                self.total_prompt_tokens += len(out.prompt_token_ids)
                if out.queue_time is not None:
                    self.queue_time.labels(name).observe(max(0.0, out.queue_time))
                if "scheduled" in st:
                    self.prefill_time.labels(name).observe(max(0.0, ts - st["scheduled"]))
            else:
                self.itl.labels(name).observe(ts - st["last"])
            st["last"] = ts
            self.generation_tokens.labels(name).inc(new_tokens)
            self.total_generation_tokens += new_tokens
        if out.finished:
            reasons = [o.finish_reason for o in out.outputs]
            self._finished("error" if "error" in reasons else reasons[0] or "abort")
            self.e2e.labels(name).observe(ts - stream.arrival_time)
            self.params_n.labels(name).observe(len(out.outputs))
            self.request_prompt_tokens.labels(name).observe(len(out.prompt_token_ids))
            self.request_generation_tokens.labels(name).observe(sum(len(o.token_ids) for o in out.outputs))
            if "first" in st:
                self.decode_time.labels(name).observe(max(0.0, st["last"] - st["first"]))
                if "scheduled" in st:
                    self.inference_time.labels(name).observe(max(0.0, st["last"] - st["scheduled"]))

    def on_lora_request(self, lora_name: str) -> None:
        self.lora_requests.labels(self.model_name, lora_name).inc()

    def on_step_tokens(self, counts: list[int]) -> None:
        h = self.iteration_tokens.labels(self.model_name)
        for n in counts:
            h.observe(n)

    def render(self) -> bytes:
        text = generate_latest(self.registry)
        if self.compat_registry is not None:
            text += generate_latest(self.compat_registry)
        return text


class StatsLogger:
    """vLLM's periodic log line while the engine is busy: throughput over the last interval,
    running/waiting sequences, KV-cache usage and the prefix-cache hit rate. Quiet while idle (the
    first interval after work still reports, so the log shows the engine winding down)."""

    def __init__(self, metrics: ServerMetrics, stats: Callable[[], SchedulerStats], interval_s: float = 5.0):
        self.metrics = metrics
        self.stats = stats
        self.interval_s = interval_s
        self._last = self._snapshot(time.monotonic())

    def _snapshot(self, now: float) -> tuple:
        s = self.stats()
        return now, self.metrics.total_prompt_tokens, self.metrics.total_generation_tokens, s.prefix_queries, s.prefix_hits

    def line(self, now: float | None = None) -> str | None:
        """The line for the interval since the last call (None when nothing happened in it); the
        next interval starts here."""
        now = time.monotonic() if now is None else now
        t0, p0, g0, q0, h0 = self._last
        snap = self._snapshot(now)
        self._last = snap
        _, p1, g1, q1, h1 = snap
        s = self.stats()
        if p1 == p0 and g1 == g0 and not s.num_running and not s.num_waiting:
            return None
        dt = max(now - t0, 1e-9)
        hit_rate = 100.0 * (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
        return (f"Avg prompt throughput: {(p1 - p0) / dt:.1f} tokens/s, Avg generation throughput: "
                f"{(g1 - g0) / dt:.1f} tokens/s, Running: {s.num_running} reqs, Waiting: {s.num_waiting} reqs, "
                f"KV cache usage: {100.0 * s.kv_usage:.1f}%, Prefix cache hit rate: {hit_rate:.1f}%")

    async def run(self) -> None:
        import asyncio
        while True:
            await asyncio.sleep(self.interval_s)
            text = self.line()
            if text is not None:
                logger.info("%s", text)
