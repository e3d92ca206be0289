"""The TTFT breakdown end to end: a server started with SPLITSERVE_TTFT_LOG writes one line per
streamed request (completions, chat, n > 1) whose components add up to its total, and that total
lies within the client's own time to first token; non-streamed requests write none; and
benchmarks/ttft_breakdown.py summarizes the log."""
import json
import subprocess
import sys
import time

from pathlib import Path

import httpx
import pytest

from reliability_support import running_server

SUMMARY = Path(__file__).resolve().parents[2] / "benchmarks" / "ttft_breakdown.py"
COMPONENTS = ("front", "to_core", "wait", "schedule", "ahead", "prefill", "gaps", "core_out", "to_front", "output")


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("ttft") / "ttft.jsonl"
    # a small budget, so the long prompt is chunked
    with running_server(tiny_model_dir, ["--max-num-seqs", "8", "--max-num-batched-tokens", "64"],
                        env={"SPLITSERVE_TTFT_LOG": str(log)}) as srv:
        yield srv, log


def _stream_ttft(url: str, path: str, body: dict) -> float:
    t0 = time.monotonic()
    first = None
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if first is None and line.startswith("data: ") and line[6:] != "[DONE]":
                choice = (json.loads(line[6:]).get("choices") or [{}])[0]
                delta = choice.get("delta") or {}
                if choice.get("text") is not None or (delta.get("content") is not None and not delta.get("role")):
                    first = time.monotonic() - t0  # (a chat stream's role event comes before any token)
    return first


def test_one_consistent_line_per_streamed_request(served, tmp_path):
    srv, log = served
    client_ttft = [_stream_ttft(srv.url, "/v1/completions", {"prompt": [5] * 200, "max_tokens": 3, "ignore_eos": True}),
                   _stream_ttft(srv.url, "/v1/completions", {"prompt": "hello there", "max_tokens": 3, "n": 2}),
                   _stream_ttft(srv.url, "/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})]
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "not streamed", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(lines) == 3
    for d, client in zip(lines, client_ttft):
        assert abs(sum(d[c] for c in COMPONENTS) - d["total"]) < 0.05, d
        assert all(d[c] >= -0.01 for c in COMPONENTS), d
        assert 0 < d["total"] <= client * 1e3 + 1, (d, client)
        assert d["chunks"] == len(d["chunk_tokens"]) == len(d["step_tokens"]) >= 1
    assert lines[0]["chunks"] == 4 and sum(lines[0]["chunk_tokens"]) == 200  # 64 + 64 + 64 + 8
    out = subprocess.run([sys.executable, str(SUMMARY), str(log), "--json", str(tmp_path / "s.json")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "slowest 1%" in out.stdout
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["n"] == 3 and s["slowest_1pct"]["n"] >= 1
