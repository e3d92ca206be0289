"""`splitserve bench sweep`: the same request set at several request rates, then a plot of
latency against achieved throughput (the curve engines are compared by: how much latency each
extra token/s of load costs, and where the server saturates)."""
from __future__ import annotations

import math

from splitserve.bench.datasets import BenchError
from splitserve.bench.metrics import BenchmarkMetrics


def parse_rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            rate = float(part)
        except ValueError:
            raise BenchError(f"--request-rates: {part!r} is not a number (use e.g. 1,2,4,inf)") from None
        if not rate > 0:
            raise BenchError(f"--request-rates: rates must be positive, got {part}")
        rates.append(rate)
    if not rates:
        raise BenchError("--request-rates needs at least one rate, e.g. 1,2,4,inf")
    return rates


def _rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def format_sweep_table(points: list[tuple[float, BenchmarkMetrics]]) -> str:
    head = (f"{'rate':>6} {'ok':>5} {'fail':>5} {'req/s':>7} {'out tok/s':>10} "
            f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'E2E p50':>9} {'E2E p99':>9}")
    lines = ["Sweep summary (latencies in ms)", head, "-" * len(head)]

    def ms(x: float) -> str:
        return "n/a" if math.isnan(x) else f"{x * 1000:.1f}"

    for rate, m in points:
        lines.append(f"{_rate_label(rate):>6} {m.completed:>5} {m.failed:>5} {m.request_throughput:>7.2f} "
                     f"{m.output_throughput:>10.1f} {ms(m.ttft.median):>9} {ms(m.ttft.p99):>9} "
                     f"{ms(m.tpot.median):>9} {ms(m.tpot.p99):>9} {ms(m.e2e.median):>9} {ms(m.e2e.p99):>9}")
    return "\n".join(lines)


def plot_sweep(points: list[tuple[float, BenchmarkMetrics]], path: str, title: str) -> None:
    """One panel each for TTFT, TPOT and E2E latency (median and p99, ms) against output token
    throughput; every point is labelled with the request rate that produced it."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only; never needs a display
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("the sweep plot needs matplotlib: pip install 'splitserve[bench]' (or pip install matplotlib)") from None

    xs = [m.output_throughput for _, m in points]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, name in zip(axes, ("ttft", "tpot", "e2e"),
                             ("Time to first token", "Time per output token", "End-to-end latency")):
        med = [getattr(m, key).median * 1000 for _, m in points]
        p99 = [getattr(m, key).p99 * 1000 for _, m in points]
        ax.plot(xs, med, "o-", label="median")
        ax.plot(xs, p99, "s--", label="p99")
        for (rate, _), x, y in zip(points, xs, med):
            if not (math.isnan(x) or math.isnan(y)):
                ax.annotate(_rate_label(rate), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_title(name)
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel("latency (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title + "  (point labels: request rate, req/s)")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise BenchError(f"cannot write plot {path}: {e}", 1) from None
    finally:
        plt.close(fig)
