"""Per-request measurements and the summary figures computed from them.

Definitions (all times in seconds, measured on the client with time.perf_counter):
  TTFT  time from sending the request to the first chunk that carries non-empty output text.
        Role-only or empty chunks are not tokens, so they do not end TTFT.
  ITL   the gaps between successive content chunks of one request. A chunk may carry more
        than one token (speculative decoding, server-side coalescing); ITL then measures what
        a user sees, one gap per chunk, and TPOT below still gives the per-token figure.
  TPOT  (e2e - ttft) / (output_tokens - 1): the decode time per token after the first.
        Undefined for single-token outputs, which are left out of the TPOT statistics.
  E2E   time from sending the request to the end of the stream.
Throughputs divide by the benchmark duration (first request sent to last response finished)
and count successful requests only: failed requests did no useful work.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0                 # tokens: server usage when reported, else client count
    output_len: int = 0                 # tokens: server usage when reported, else client count
    usage_reported: bool = False        # whether output_len came from the server
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    start: float = 0.0                  # send time relative to the benchmark start
    generated_text: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_len < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)


@dataclass
class Distribution:
    mean: float
    median: float
    std: float
    p90: float
    p99: float
    count: int

    @classmethod
    def of(cls, values: list[float]) -> "Distribution":
        if not values:
            nan = float("nan")
            return cls(nan, nan, nan, nan, nan, 0)
        a = np.asarray(values, dtype=np.float64)
        p50, p90, p99 = np.percentile(a, PERCENTILES)
        return cls(float(a.mean()), float(p50), float(a.std()), float(p90), float(p99), len(a))


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    duration: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    max_concurrency_seen: int
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    errors: dict[str, int]

    def to_dict(self) -> dict:
        d = asdict(self)
        # JSON has no NaN; None says "no data" plainly to any reader of the file.
        for key in ("ttft", "tpot", "itl", "e2e"):
            d[key] = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d[key].items()}
        return d


def summarize_errors(results: list[RequestResult], limit: int = 200) -> dict[str, int]:
    """Group failures by message so a thousand identical errors read as one line with a count."""
    counts = Counter((r.error or "unknown error")[:limit] for r in results if not r.success)
    return dict(counts.most_common())


def peak_concurrency(results: list[RequestResult]) -> int:
    """Most requests in flight at once, from the send/finish times of every request."""
    events = []
    for r in results:
        events.append((r.start, 1))
        events.append((r.start + r.e2e, -1))
    events.sort(key=lambda e: (e[0], e[1]))  # a finish at the same instant as a start frees first
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak


def compute_metrics(results: list[RequestResult], duration: float) -> BenchmarkMetrics:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    safe = duration if duration > 0 else float("nan")
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration=duration,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / safe,
        output_throughput=total_out / safe,
        total_token_throughput=(total_in + total_out) / safe,
        max_concurrency_seen=peak_concurrency(results),
        ttft=Distribution.of([r.ttft for r in ok]),
        tpot=Distribution.of([t for r in ok if (t := r.tpot) is not None]),
        itl=Distribution.of([g for r in ok for g in r.itl]),
        e2e=Distribution.of([r.e2e for r in ok]),
        errors=summarize_errors(results),
    )


def _ms(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x * 1000:.2f}"


def format_table(m: BenchmarkMetrics, title: str = "Serving benchmark") -> str:
    width = 60
    lines = [f" {title} ".center(width, "=")]

    def row(label: str, value) -> None:
        lines.append(f"{label:<42}{value:>18}")

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    row("Benchmark duration (s):", f"{m.duration:.2f}")
    row("Peak concurrent requests:", m.max_concurrency_seen)
    row("Total input tokens:", m.total_input_tokens)
    row("Total output tokens:", m.total_output_tokens)
    row("Request throughput (req/s):", f"{m.request_throughput:.2f}")
    row("Output token throughput (tok/s):", f"{m.output_throughput:.2f}")
    row("Total token throughput (tok/s):", f"{m.total_token_throughput:.2f}")
    for key, name in (("ttft", "Time to first token"), ("tpot", "Time per output token (excl. 1st)"),
                      ("itl", "Inter-token latency"), ("e2e", "End-to-end latency")):
        d: Distribution = getattr(m, key)
        lines.append(f" {name} ".center(width, "-"))
        short = key.upper()
        row(f"Mean {short} (ms):", _ms(d.mean))
        row(f"Median {short} (ms):", _ms(d.median))
        row(f"P90 {short} (ms):", _ms(d.p90))
        row(f"P99 {short} (ms):", _ms(d.p99))
    if m.errors:
        lines.append(" Errors ".center(width, "-"))
        for msg, n in list(m.errors.items())[:10]:
            lines.append(f"{n:>6} x {msg}")
        if len(m.errors) > 10:
            lines.append(f"       ... and {len(m.errors) - 10} other distinct errors (see --save-result)")
    lines.append("=" * width)
    return "\n".join(lines)
