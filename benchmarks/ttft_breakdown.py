"""Where the slowest first tokens spend their time, from a server's TTFT log (SPLITSERVE_TTFT_LOG).

    SPLITSERVE_TTFT_LOG=ttft.jsonl splitserve serve ...   # one JSON line per streamed request
    python benchmarks/ttft_breakdown.py ttft.jsonl [--lines A:B] [--json out.json]

Prints the server's TTFT (handler start to the first event written) at the median and P99, and the
mean of each component (ttft_trace.py says what each is) over the median band (45-55th
percentile) and over the slowest 1% (at least one request), with their chunks, step sizes, and GC
and kernel-compile time. --lines A:B takes the log's lines A..B-1 (one run of several in one log).
`table` (used by benchmarks/ttft_breakdown.sh) makes the final table of several runs.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

COMPONENTS = ("front", "to_core", "wait", "schedule", "ahead", "prefill", "gaps", "core_out", "to_front", "output")
EXTRA = ("chunks", "gc_core", "gc_front", "compile_core", "alloc_retries")


def read(path: str, lines: str | None = None) -> list[dict]:
    with open(path) as f:
        rows = f.readlines()
    if lines:
        a, _, b = lines.partition(":")
        rows = rows[int(a or 0):int(b) if b else None]
    return [json.loads(r) for r in rows if r.strip()]


def band(rows: list[dict], lo: float, hi: float) -> list[dict]:
    """The rows whose total lies in the [lo, hi] quantiles (at least the one nearest hi)."""
    rows = sorted(rows, key=lambda r: r["total"])
    n = len(rows)
    i, j = int(np.floor(lo * (n - 1))), int(np.ceil(hi * (n - 1)))
    return rows[i:j + 1] or rows[-1:]


def mean_of(rows: list[dict]) -> dict:
    out = {k: float(np.mean([r.get(k, 0) for r in rows])) for k in ("total",) + COMPONENTS + EXTRA}
    out["step_tokens_max"] = float(np.mean([max(r["step_tokens"], default=0) for r in rows]))
    out["step_ms_max"] = float(np.mean([max(r["step_ms"], default=0.0) for r in rows]))
    out["n"] = len(rows)
    return out


def summarize(rows: list[dict]) -> dict:
    totals = np.array([r["total"] for r in rows])
    return {"n": len(rows), "median": float(np.median(totals)), "p99": float(np.percentile(totals, 99)),
            "median_band": mean_of(band(rows, 0.45, 0.55)), "slowest_1pct": mean_of(band(rows, 0.99, 1.0))}


def top(s: dict, k: int = 3) -> str:
    """The k largest components of a band, "name ms" each."""
    items = sorted(((s[c], c) for c in COMPONENTS), reverse=True)[:k]
    return ", ".join(f"{c} {v:.0f}" for v, c in items)


def print_summary(s: dict, title: str = "") -> None:
    print(f"--- TTFT breakdown{' ' + title if title else ''}: {s['n']} requests, server TTFT median "
          f"{s['median']:.1f} ms, P99 {s['p99']:.1f} ms")
    hdr = f"{'':16s}" + "".join(f"{c:>9s}" for c in ("total",) + COMPONENTS)
    print(hdr)
    for name, key in (("median band", "median_band"), ("slowest 1%", "slowest_1pct")):
        b = s[key]
        print(f"{name + ' (' + str(b['n']) + ')':16s}" + "".join(f"{b[c]:9.1f}" for c in ("total",) + COMPONENTS))
    for name, key in (("median band", "median_band"), ("slowest 1%", "slowest_1pct")):
        b = s[key]
        print(f"  {name}: chunks {b['chunks']:.1f}, largest step {b['step_tokens_max']:.0f} tokens / "
              f"{b['step_ms_max']:.1f} ms, GC core {b['gc_core']:.1f} ms, GC front {b['gc_front']:.1f} ms, "
              f"kernel compiles {b['compile_core']:.1f} ms, allocator retries {b['alloc_retries']:.1f}")


def table(runs: list[dict]) -> str:
    """Runs: {"label", "bench": bench serve's saved result, "ttft": summarize()} -> the final table."""
    lines = [f"{'run':22s} {'TTFT med':>8s} {'TTFT P99':>8s} {'TPOT med':>8s} {'ITL med':>8s} {'ITL P99':>8s}  "
             f"P99 requests (server TTFT ms: largest components)"]
    for r in runs:
        m = r["bench"]["metrics"]
        ms = lambda key, stat: f"{(m[key][stat] or float('nan')) * 1e3:8.1f}"  # noqa: E731 (seconds in the file)
        b = r["ttft"]["slowest_1pct"] if r.get("ttft") else None
        detail = f"{b['total']:.0f}: {top(b)}" if b else "no TTFT log"
        lines.append(f"{r['label']:22s} {ms('ttft', 'median')} {ms('ttft', 'p99')} {ms('tpot', 'median')} "
                     f"{ms('itl', 'median')} {ms('itl', 'p99')}  {detail}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log", help="the server's SPLITSERVE_TTFT_LOG file")
    ap.add_argument("--lines", help="A:B, the log's lines A..B-1 only")
    ap.add_argument("--title", default="")
    ap.add_argument("--json", help="also write the summary here")
    args = ap.parse_args(argv)
    rows = read(args.log, args.lines)
    if not rows:
        print("no requests in the TTFT log (was SPLITSERVE_TTFT_LOG set for the server?)")
        return 1
    s = summarize(rows)
    print_summary(s, args.title)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
