"""Request building, SSE parsing, the arrival schedule and the dispatcher (no server needed)."""
from __future__ import annotations

import asyncio
import math
import time

import numpy as np
import pytest

from splitserve.bench.datasets import BenchError, SampleRequest
from splitserve.bench.metrics import RequestResult
from splitserve.bench.serve import (DONE, BenchConfig, _chunk_error, _chunk_text, _error_text, arrival_offsets,
                                    build_request, check_server, fill_token_counts, normalize_base_url,
                                    parse_sse_line, run_requests)


def test_parse_sse_line():
    assert parse_sse_line("") is None
    assert parse_sse_line(": keep-alive") is None
    assert parse_sse_line("event: message") is None
    assert parse_sse_line("data: [DONE]") is DONE
    assert parse_sse_line("data:[DONE]\r") is DONE
    assert parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert parse_sse_line('data:{"a":1}') == {"a": 1}
    with pytest.raises(ValueError):
        parse_sse_line("data: {not json")
    with pytest.raises(ValueError):
        parse_sse_line("data: [1, 2]")


def test_chunk_text_and_errors():
    assert _chunk_text({"choices": [{"text": " hi", "finish_reason": None}]}, chat=False) == (" hi", False, True)
    # a token whose text is held back (or empty) is still a token event, as vLLM's client counts it
    assert _chunk_text({"choices": [{"text": "", "finish_reason": None}]}, chat=False) == ("", False, True)
    assert _chunk_text({"choices": [{"text": "", "finish_reason": "stop"}]}, chat=False) == ("", True, False)
    assert _chunk_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, chat=True) == ("", False, False)
    assert _chunk_text({"choices": [{"delta": {"content": ""}}]}, chat=True) == ("", False, True)
    assert _chunk_text({"choices": [{"delta": {}, "finish_reason": "stop"}]}, chat=True) == ("", True, False)
    assert _chunk_text({"choices": [{"delta": {"reasoning_content": "hm"}, "finish_reason": "stop"}]}, chat=True) == ("hm", True, True)
    assert _chunk_text({"choices": [], "usage": {"completion_tokens": 3}}, chat=False) == ("", False, False)
    assert _chunk_error({"error": {"message": "bad"}}) == "bad"
    assert _chunk_error({"object": "error", "message": "oom"}) == "oom"
    assert _chunk_error({"choices": []}) is None
    assert _error_text('{"error": {"message": "model x not found"}}') == "model x not found"
    assert _error_text('{"detail": "Not Found"}') == "Not Found"
    assert _error_text("<html>\n bad gateway </html>") == "<html> bad gateway </html>"


def test_build_request():
    cfg = BenchConfig(base_url="http://h:1", model="m", ignore_eos=True, temperature=0.0, extra_body={"top_k": 1})
    url, body = build_request(cfg, SampleRequest("hello", 1, 7))
    assert url == "http://h:1/v1/completions"
    assert body == {"model": "m", "prompt": "hello", "max_tokens": 7, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0, "top_k": 1}
    chat = BenchConfig(base_url="http://h:1", model="m", endpoint="chat")
    url, body = build_request(chat, SampleRequest("look", 1, 3, images=["data:image/png;base64,AA"]))
    assert url == "http://h:1/v1/chat/completions"
    assert body["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]
    assert "ignore_eos" not in body and "temperature" not in body
    # --lora-modules: a request that names an adapter sends that name instead of the run's model
    _, body = build_request(cfg, SampleRequest("hi", 1, 2, model="adapter-3"))
    assert body["model"] == "adapter-3"


def test_normalize_base_url():
    assert normalize_base_url("http://h:8000/v1/") == "http://h:8000"
    assert normalize_base_url(" https://h ") == "https://h"
    with pytest.raises(BenchError):
        normalize_base_url("h:8000")


def test_arrival_offsets():
    g = np.random.default_rng(0)
    assert not arrival_offsets(5, math.inf, 1.0, g).any()
    for shape, cv in ((1.0, 1.0), (0.25, 2.0), (4.0, 0.5)):
        gaps = np.diff(arrival_offsets(40001, 10.0, shape, np.random.default_rng(1)))
        assert abs(gaps.mean() - 0.1) < 0.004             # mean gap is 1/rate whatever the burstiness
        assert abs(gaps.std() / gaps.mean() - cv) < 0.06  # CV = 1/sqrt(shape): 1 is Poisson
    a = arrival_offsets(10, 2.0, 1.0, np.random.default_rng(7))
    assert a[0] == 0 and np.all(np.diff(a) >= 0)
    assert np.array_equal(a, arrival_offsets(10, 2.0, 1.0, np.random.default_rng(7)))
    with pytest.raises(BenchError):
        arrival_offsets(3, 0.0, 1.0, g)
    with pytest.raises(BenchError):
        arrival_offsets(3, 1.0, 0.0, g)


def _fake_sender(hold: float, log: list, in_flight: list):
    async def send(sample):
        r = RequestResult(start=time.perf_counter())
        in_flight[0] += 1
        in_flight[1] = max(in_flight[1], in_flight[0])
        log.append(r.start)
        await asyncio.sleep(hold)
        in_flight[0] -= 1
        r.success, r.e2e, r.ttft, r.output_len = True, hold, hold, 1
        if sample.prompt == "boom":
            raise RuntimeError("client bug")
        return r
    return send


def test_dispatcher_follows_schedule():
    cfg = BenchConfig(base_url="http://x", model="m", request_rate=20.0, disable_tqdm=True)
    samples = [SampleRequest("p", 1, 1) for _ in range(10)]
    log, flight = [], [0, 0]
    results, duration = asyncio.run(run_requests(cfg, samples, np.random.default_rng(5), _fake_sender(0.01, log, flight)))
    expected = arrival_offsets(10, 20.0, 1.0, np.random.default_rng(5))
    actual = np.array([r.start for r in results])
    assert np.all(np.abs(actual - expected) < 0.03), (actual, expected)
    assert duration >= expected[-1] + 0.01


def test_dispatcher_caps_concurrency_and_counts_client_errors():
    cfg = BenchConfig(base_url="http://x", model="m", max_concurrency=3, disable_tqdm=True)
    samples = [SampleRequest("p", 1, 1) for _ in range(8)] + [SampleRequest("boom", 1, 1)]
    log, flight = [], [0, 0]
    results, duration = asyncio.run(run_requests(cfg, samples, np.random.default_rng(0), _fake_sender(0.05, log, flight)))
    assert flight[1] == 3
    assert 0.15 <= duration < 0.4   # 9 requests, 3 at a time, 50 ms each: three waves
    assert len(results) == 9 and results[-1].success is False and "client bug" in results[-1].error


def test_fill_token_counts_only_without_usage():
    class Tok:
        def encode(self, text, add_special_tokens=False):
            return text.split()
    a = RequestResult(success=True, generated_text="a b c", output_len=0)
    b = RequestResult(success=True, generated_text="a b c", output_len=7, usage_reported=True)
    fill_token_counts([a, b], Tok())
    assert (a.output_len, b.output_len) == (3, 7)


def test_check_server_unreachable_is_fast():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = time.perf_counter()
    with pytest.raises(BenchError, match="cannot reach server") as e:
        check_server(f"http://127.0.0.1:{port}", timeout=2.0)
    assert e.value.exit_code == 1
    assert time.perf_counter() - t < 2.5
