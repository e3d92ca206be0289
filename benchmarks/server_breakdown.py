"""Where a served request's time goes, from the server's own histograms (mean per request).

    python benchmarks/server_breakdown.py URL --save before.prom          # before a run
    python benchmarks/server_breakdown.py URL --since before.prom         # after it: the run's share

The client's TTFT less the server's is the HTTP side: request parsing, tokenization, the first
event's serialization and the socket. The server's TTFT splits into queue time (front's arrival, after
tokenization, to the step that first schedules the request) and prefill time (that step's start to the
first token reaching the front, which includes the step already in flight when the request was
scheduled). Means come from each histogram's _sum and _count over the run.
"""
from __future__ import annotations

import argparse
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

HISTOGRAMS = (("time_to_first_token_seconds", "server TTFT"), ("request_queue_time_seconds", "  queue"),
              ("request_prefill_time_seconds", "  prefill (incl. the step in flight)"),
              ("inter_token_latency_seconds", "ITL (between engine outputs)"),
              ("request_decode_time_seconds", "decode time per request"))


def sums_and_counts(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith(("_sum", "_count")):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:8011")
    ap.add_argument("--save", help="write the current /metrics text to this file")
    ap.add_argument("--since", help="print the means of the histograms since this saved scrape")
    args = ap.parse_args(argv)
    with urllib.request.urlopen(args.url.rstrip("/") + "/metrics", timeout=10) as r:
        text = r.read().decode()
    if args.save:
        with open(args.save, "w") as f:
            f.write(text)
    if args.since:
        with open(args.since) as f:
            before = sums_and_counts(f.read())
        now = sums_and_counts(text)
        for name, label in HISTOGRAMS:
            key = f"splitserve:{name}"
            n = now.get(key + "_count", 0.0) - before.get(key + "_count", 0.0)
            total = now.get(key + "_sum", 0.0) - before.get(key + "_sum", 0.0)
            mean = f"{total / n * 1e3:8.2f} ms" if n else "       —"
            print(f"{label:40s} mean {mean}  ({int(n)} observations)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
