"""Overload: with 2 running sequences and 3 queued at most, a burst of 40 requests gets 503 with
Retry-After for the excess, at once (while the admitted ones are still running); the admitted ones
complete; the running and waiting counts never exceed their limits (sampled throughout)."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from conftest import metric_value
from reliability_support import CALL_TIMEOUT_S, gather_bounded, metric, running_server, stream_completion, wait_idle

MAX_SEQS, MAX_QUEUED = 2, 3
SERVER_FLAGS = ["--max-num-seqs", str(MAX_SEQS), "--max-queued-requests", str(MAX_QUEUED)]
BURST = 40
TOKENS = 300  # long enough that the whole burst arrives while the admitted ones still run


@pytest.fixture(scope="module")
def srv(tiny_model_dir):
    with running_server(tiny_model_dir, SERVER_FLAGS) as s:
        yield s


class CountSampler(threading.Thread):
    """Reads the running and waiting gauges over and over until stopped; keeps the maxima."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.max_running, self.max_waiting, self.samples = url, 0.0, 0.0, 0
        self.halt = threading.Event()

    def run(self):
        with httpx.Client(timeout=10) as c:
            while not self.halt.is_set():
                text = c.get(self.url + "/metrics").text
                self.max_running = max(self.max_running, metric_value(text, "splitserve:num_requests_running"))
                self.max_waiting = max(self.max_waiting, metric_value(text, "splitserve:num_requests_waiting"))
                self.samples += 1
                time.sleep(0.01)


def test_burst_gets_503_for_the_excess_and_completes_the_rest(srv):
    sampler = CountSampler(srv.url)
    sampler.start()
    body = {"prompt": "Once upon a time", "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0}
    events: list[tuple[float, str]] = []

    async def one(c: httpx.AsyncClient, i: int):
        res = await stream_completion(c, srv.url, body)
        events.append((time.monotonic(), "503" if res.status == 503 else "done"))
        return res

    async def run():
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=BURST + 5)) as c:
            return await gather_bounded([one(c, i) for i in range(BURST)], BURST)

    try:
        results = asyncio.run(run())
    finally:
        sampler.halt.set()
        sampler.join(10)
    ok = [r for r in results if not isinstance(r, BaseException) and r.status == 200]
    rejected = [r for r in results if not isinstance(r, BaseException) and r.status == 503]
    assert len(ok) + len(rejected) == BURST, [repr(r) for r in results if isinstance(r, BaseException)]
    assert len(ok) >= MAX_SEQS + MAX_QUEUED and rejected
    for r in ok:
        assert r.done and r.error is None and r.finish_reason == "length" and r.chunks >= 1
    for r in rejected:
        assert int(r.headers["retry-after"]) >= 1
        assert r.body["error"]["code"] == "service_unavailable" and "max-queued-requests" in r.body["error"]["message"]
    # "at once": every 503 came back before the first admitted request had finished
    first_done = min(t for t, kind in events if kind == "done")
    assert all(t < first_done for t, kind in events if kind == "503")
    assert sampler.samples >= 3
    assert sampler.max_running <= MAX_SEQS and sampler.max_waiting <= MAX_QUEUED, vars(sampler)
    wait_idle(srv.url)


def test_n_larger_than_the_queue_is_a_400_and_n_counts_against_it(srv):
    most = MAX_QUEUED + MAX_SEQS
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": most + 1},
                   timeout=CALL_TIMEOUT_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": most},
                   timeout=CALL_TIMEOUT_S)
    assert r.status_code == 200 and len(r.json()["choices"]) == most
    wait_idle(srv.url)
