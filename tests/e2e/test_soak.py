"""A bounded soak (benchmarks/soak.py, smaller): 300 streaming requests at concurrency 32 on the tiny
model after a warm-up. Zero failures, the server healthy and idle afterwards, and its memory back
to the level before the load within a small margin. (The full 2,000-request run on the default
model is recorded in RELIABILITY.md.)"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from reliability_support import running_server

MEMORY_MARGIN_MIB = 48  # the server's RSS is ~1.5 GiB (mostly the KV cache); a leak per request shows beyond this


def load_soak_module():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"
    spec = importlib.util.spec_from_file_location("soak", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_soak_streams_without_failures_or_memory_growth(tiny_model_dir):
    soak = load_soak_module()
    with running_server(tiny_model_dir, ["--max-num-seqs", "32"]) as srv:
        summary = soak.soak(srv.url, srv.proc.pid, requests=300, concurrency=32, max_tokens=24)
        print(summary)
        assert summary["failures"] == 0, summary["failure_examples"]
        assert summary["health"] == 200
        assert summary["rss_growth_mib"] <= MEMORY_MARGIN_MIB, summary
