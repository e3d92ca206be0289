"""`splitserve router` over fake workers (threads of this process): how it balances, keeps prefixes
together, takes a failing worker out and back, streams, and counts."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.e2e.conftest import metric_value
from tests.router.conftest import NEEDS_ROUTER

pytestmark = NEEDS_ROUTER


def complete(router, prompt: str, **kw) -> str:
    r = httpx.post(router.url + "/v1/completions", json={"model": "fake-model", "prompt": prompt, "max_tokens": 4, **kw},
                   timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"].removeprefix("from ")


def hold_one(router, prompt: str) -> threading.Thread:
    """A request that stays in flight (its worker waits on `hold`) until the test releases it."""
    t = threading.Thread(target=complete, args=(router, prompt), daemon=True)
    t.start()
    return t


def wait_in_flight(workers, total: int) -> None:
    deadline = time.monotonic() + 10
    while sum(w.in_flight for w in workers) < total:
        assert time.monotonic() < deadline, "the held request never reached a worker"
        time.sleep(0.02)


def test_round_robin_alternates(fake_workers, start_router):
    a, b = fake_workers("a"), fake_workers("b")
    router = start_router(["--worker-urls", a.url, b.url, "--policy", "round_robin"], expect_healthy=2)
    served = [complete(router, f"prompt {i}") for i in range(10)]
    assert served.count("a") == 5 and served.count("b") == 5
    assert all(x != y for x, y in zip(served, served[1:]))


def test_least_load_avoids_the_worker_with_a_request_in_flight(fake_workers, start_router):
    """Its own count of requests in flight decides, at once (no wait for a poll of /get_load)."""
    a, b = fake_workers("a"), fake_workers("b")
    router = start_router(["--worker-urls", a.url, b.url, "--policy", "least_load"], expect_healthy=2)
    a.hold.clear()
    b.hold.clear()
    held = hold_one(router, "this one waits HOLD")
    wait_in_flight([a, b], 1)
    busy = a if a.in_flight else b
    idle = b if busy is a else a
    assert {complete(router, f"quick {i}") for i in range(6)} == {idle.name}
    a.hold.set()
    b.hold.set()
    held.join(10)
    assert len(busy.completions()) == 1 and len(idle.completions()) == 6


def test_cache_aware_keeps_a_prefix_on_one_worker_and_sends_a_new_one_where_load_is_least(fake_workers, start_router):
    a, b = fake_workers("a"), fake_workers("b")
    router = start_router(["--worker-urls", a.url, b.url, "--policy", "cache_aware"], expect_healthy=2)
    system = {k: f"System prompt {k}: you answer questions about subject {k} with care. " * 4 for k in range(2)}
    a.hold.clear()
    b.hold.clear()
    held = hold_one(router, system[0] + "first question HOLD")
    wait_in_flight([a, b], 1)
    first = "a" if a.in_flight else "b"
    # a new prefix matches nothing: it goes to the least-loaded worker (the other one)
    second = complete(router, system[1] + "first question")
    assert second != first
    a.hold.set()
    b.hold.set()
    held.join(10)
    # later requests with either prefix follow it to its worker (the load is even again)
    for i in range(5):
        assert complete(router, system[0] + f"question {i}") == first
        assert complete(router, system[1] + f"question {i}") == second


def test_a_failing_worker_is_taken_out_and_back(fake_workers, start_router):
    a, b = fake_workers("a"), fake_workers("b")
    router = start_router(["--worker-urls", a.url, b.url, "--policy", "round_robin"], expect_healthy=2)
    a.healthy = False
    router.wait_healthy(1, timeout=15)
    assert {complete(router, f"while a is out {i}") for i in range(6)} == {"b"}
    a.healthy = True
    router.wait_healthy(2, timeout=15)
    assert {complete(router, f"a is back {i}") for i in range(6)} == {"a", "b"}


def test_a_stopped_worker_is_skipped_and_the_answers_keep_coming(fake_workers, start_router):
    a, b = fake_workers("a"), fake_workers("b")
    router = start_router(["--worker-urls", a.url, b.url, "--policy", "round_robin"], expect_healthy=2)
    a.stop()  # nothing listens on its port any more: connection refused
    assert {complete(router, f"after a stopped {i}") for i in range(6)} == {"b"}


def test_sse_passes_through_chunk_by_chunk(fake_workers, start_router):
    a = fake_workers("a", chunks=5, chunk_delay_s=0.3)
    router = start_router(["--worker-urls", a.url], expect_healthy=1)
    arrivals, events = [], []
    t0 = time.monotonic()
    with httpx.stream("POST", router.url + "/v1/chat/completions", timeout=30, json={
            "model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic() - t0)
                events.append(line[6:])
    assert events[-1] == "[DONE]" and len(events) == 6
    # each chunk left the worker 0.3 s after the one before; buffered, they would arrive together
    gaps = [y - x for x, y in zip(arrivals, arrivals[1:5])]
    assert all(g > 0.15 for g in gaps), gaps


def test_models_come_from_a_healthy_worker_and_metrics_count(fake_workers, start_router):
    a, b = fake_workers("a"), fake_workers("b")
    router = start_router(["--worker-urls", a.url, b.url, "--policy", "round_robin"], expect_healthy=2)
    models = httpx.get(router.url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["fake-model"]
    a.healthy = False
    router.wait_healthy(1, timeout=15)
    assert httpx.get(router.url + "/v1/models", timeout=10).json()["data"][0]["owned_by"] == "b"
    for i in range(4):
        complete(router, f"counted {i}")
    text = httpx.get(router.metrics_url, timeout=10).text
    assert metric_value(text, "vllm_router_requests_total", {"route": "/v1/completions"}) == 4
    assert metric_value(text, "vllm_router_processed_requests_total", {"worker": b.url}) == 4


def test_least_load_spreads_concurrent_streams_evenly(fake_workers, start_router):
    """Streams count as in flight until they end: six long streams split three and three."""
    a, b = fake_workers("a", chunks=4, chunk_delay_s=0.5), fake_workers("b", chunks=4, chunk_delay_s=0.5)
    router = start_router(["--worker-urls", a.url, b.url, "--policy", "least_load"], expect_healthy=2)

    def stream(i: int) -> None:
        with httpx.stream("POST", router.url + "/v1/completions", timeout=30,
                          json={"model": "fake-model", "prompt": f"stream {i}", "stream": True}) as r:
            for _ in r.iter_lines():
                pass
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join(30)
    assert len(a.completions()) == 3 and len(b.completions()) == 3
