"""`splitserve router` in front of two real `splitserve serve` processes (the default model, on CPU).

The two servers start once for the module (slow: loading the model takes tens of seconds on a CPU);
each test starts its own router (a fraction of a second). The last test SIGKILLs one server.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import DEFAULT_ARGS, ServerProcess, metric_value
from tests.router.conftest import NEEDS_ROUTER

pytestmark = [NEEDS_ROUTER, pytest.mark.slow]


@pytest.fixture(scope="module")
def servers():
    procs = [ServerProcess(DEFAULT_ARGS) for _ in range(2)]  # both load at once
    try:
        for p in procs:
            p.wait_healthy()
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def model(servers) -> str:
    return httpx.get(servers[0].url + "/v1/models", timeout=10).json()["data"][0]["id"]


def finished(server: ServerProcess) -> float:
    """Requests the server has finished, whatever the reason (its own /metrics)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("splitserve:request_success_total{"))


def served_by(servers, send) -> int:
    """Index of the server that answered `send()` (which must wait for its answer)."""
    before = [finished(s) for s in servers]
    send()
    grew = [i for i, s in enumerate(servers) if finished(s) > before[i]]
    assert len(grew) == 1, grew
    return grew[0]


def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=300)


def test_round_robin_balances_and_answers_as_the_server_does(servers, model, start_router):
    router = start_router(["--worker-urls", *[s.url for s in servers], "--policy", "round_robin"], expect_healthy=2)
    c = client(router)
    prompt = "The three primary colors are"
    via_router = [served_by(servers, lambda: c.completions.create(model=model, prompt=f"{i}. {prompt}",
                                                                   max_tokens=1)) for i in range(6)]
    assert sorted(via_router) == [0, 0, 0, 1, 1, 1]
    # the same greedy answer through the router as from a server directly
    direct = httpx.post(servers[1].url + "/v1/completions", timeout=120,
                        json={"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0}).json()
    routed = c.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    assert routed.choices[0].text == direct["choices"][0]["text"]


def test_least_load_splits_concurrent_requests(servers, model, start_router):
    router = start_router(["--worker-urls", *[s.url for s in servers], "--policy", "least_load"], expect_healthy=2)
    c = client(router)
    before = [finished(s) for s in servers]
    errors: list[Exception] = []

    def send(i: int) -> None:
        try:
            c.completions.create(model=model, prompt=f"Request {i}: tell me a story", max_tokens=6)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert errors == []
    done = [finished(s) - b for s, b in zip(servers, before)]
    assert sum(done) == 6 and min(done) >= 2, done


def test_cache_aware_keeps_each_system_prompt_on_one_server(servers, model, start_router):
    router = start_router(["--worker-urls", *[s.url for s in servers], "--policy", "cache_aware"], expect_healthy=2)
    c = client(router)
    systems = [f"System {k}: you are an expert on topic number {k} and answer in one short sentence. " * 3
               for k in range(3)]
    seen: dict[int, set[int]] = {k: set() for k in range(3)}
    for i in range(2):
        for k, system in enumerate(systems):
            seen[k].add(served_by(servers, lambda: c.completions.create(
                model=model, prompt=system + f"Question {i}?", max_tokens=1)))
    assert all(len(v) == 1 for v in seen.values()), seen


def test_streams_token_by_token_and_models_and_metrics(servers, model, start_router):
    router = start_router(["--worker-urls", *[s.url for s in servers], "--policy", "round_robin"], expect_healthy=2)
    c = client(router)
    arrivals, pieces = [], []
    t0 = time.monotonic()
    for chunk in c.completions.create(model=model, prompt="Count from one to ten:", max_tokens=12,
                                      temperature=0, stream=True):
        arrivals.append(time.monotonic() - t0)
        pieces.append(chunk.choices[0].text)
    assert len(pieces) >= 10
    # one token per chunk, each on its own arrival: the router does not hold them back
    assert len({round(a, 3) for a in arrivals}) >= len(arrivals) - 1
    assert arrivals[-1] - arrivals[1] > 0.05 * (len(arrivals) - 2)
    assert [m.id for m in c.models.list().data] == [model]
    text = httpx.get(router.metrics_url, timeout=10).text
    assert metric_value(text, "vllm_router_requests_total", {"route": "/v1/completions"}) == 1


def test_a_killed_server_fails_its_stream_and_the_other_serves(servers, model, start_router):
    """Last in the module: SIGKILLs servers[0]."""
    router = start_router(["--worker-urls", *[s.url for s in servers], "--policy", "round_robin"], expect_healthy=2)
    c = client(router)
    outcome: dict[int, str] = {}
    first_chunk = [threading.Event(), threading.Event()]

    def stream(i: int) -> None:
        n = 0
        try:
            for _ in c.completions.create(model=model, prompt=f"Story {i}: once upon a time", max_tokens=48,
                                          temperature=0, stream=True, extra_body={"ignore_eos": True}):
                n += 1
                first_chunk[i].set()
            outcome[i] = f"completed {n}"
        except (openai.APIError, httpx.HTTPError) as e:
            outcome[i] = f"error {type(e).__name__} after {n}"
        finally:
            first_chunk[i].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.3)  # round robin: the first to servers[0], the second to servers[1]
    for e in first_chunk:
        assert e.wait(120)
    os.kill(servers[0].proc.pid, signal.SIGKILL)
    for t in threads:
        t.join(180)
    assert sorted(o.split()[0] for o in outcome.values()) == ["completed", "error"], outcome
    assert "completed 48" in outcome.values(), outcome
    # new requests go to the survivor (the router retries or skips the dead one)
    for i in range(4):
        r = c.completions.create(model=model, prompt=f"After the crash {i}", max_tokens=2)
        assert r.choices[0].text is not None
    router.wait_healthy(1, timeout=30)
    assert router.healthy_workers() == 1
