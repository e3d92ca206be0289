"""`splitserve router --pd` speaks vLLM's disaggregated-prefill protocol, checked on fake workers.

The protocol, as vLLM's toy proxy (examples/online_serving/disaggregated_serving) sends and reads it:
the client's request goes first to a prefill instance with max_tokens=1 (max_completion_tokens=1 when
given), stream=false, no stream_options, and `kv_transfer_params = {"do_remote_decode": true,
"do_remote_prefill": false, ...}`; the prefill instance's JSON answer carries `kv_transfer_params`
(remote engine id, block ids, host, port); the client's original request then goes to a decode
instance with exactly those `kv_transfer_params`, and the decode instance's answer (streamed or not)
is the client's. Both legs carry the same X-Request-Id.
"""
from __future__ import annotations

import threading
import time

import httpx

from tests.router.conftest import NEEDS_ROUTER

pytestmark = NEEDS_ROUTER


def pd_pair(fake_workers, start_router, prefills=1, decodes=1, **decode_kw):
    p = [fake_workers(f"prefill{i}", prefill=True) for i in range(prefills)]
    d = [fake_workers(f"decode{i}", **decode_kw) for i in range(decodes)]
    router = start_router(["--pd", "--prefill", *[w.url for w in p], "--decode", *[w.url for w in d]],
                          expect_healthy=prefills + decodes)
    return router, p, d


def check_leg_pair(prefill_req: dict, decode_req: dict, client_body: dict) -> None:
    sent = prefill_req["body"]
    assert sent["max_tokens"] == 1 and sent["stream"] is False and "stream_options" not in sent
    if "max_completion_tokens" in client_body:
        assert sent["max_completion_tokens"] == 1
    kv = sent["kv_transfer_params"]
    assert kv["do_remote_decode"] is True and kv["do_remote_prefill"] is False
    got = decode_req["body"]
    assert got["kv_transfer_params"] == prefill_req["returned_kv"]  # exactly what prefill returned
    for key, value in client_body.items():  # the client's own request, unchanged, otherwise
        assert got[key] == value, key
    assert prefill_req["headers"]["x-request-id"] == decode_req["headers"]["x-request-id"]


def test_completion_goes_prefill_then_decode_with_the_returned_params(fake_workers, start_router):
    router, (p,), (d,) = pd_pair(fake_workers, start_router)
    body = {"model": "fake-model", "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    r = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "from decode0"
    (pre,), (dec,) = p.completions("/v1/completions"), d.completions("/v1/completions")
    check_leg_pair(pre, dec, body)


def test_chat_stream_comes_from_decode_chunk_by_chunk(fake_workers, start_router):
    router, (p,), (d,) = pd_pair(fake_workers, start_router, chunks=4, chunk_delay_s=0.3)
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 20,
            "stream": True, "stream_options": {"include_usage": True}}
    arrivals, pieces = [], []
    t0 = time.monotonic()
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append(time.monotonic() - t0)
                pieces.append(httpx.Response(200, content=line[6:]).json()["choices"][0]["delta"]["content"])
    assert pieces == [f"decode0:{i} " for i in range(4)]
    assert all(y - x > 0.15 for x, y in zip(arrivals, arrivals[1:])), arrivals
    (pre,), (dec,) = p.completions("/v1/chat/completions"), d.completions("/v1/chat/completions")
    check_leg_pair(pre, dec, body)


def test_prefill_by_prefix_decode_by_load(fake_workers, start_router):
    router, prefills, decodes = pd_pair(fake_workers, start_router, prefills=2, decodes=2)
    for d in decodes:
        d.hold.clear()
    system = "A long shared system prompt about the history of Rome and its emperors, " * 4
    held = threading.Thread(target=httpx.post, args=(router.url + "/v1/completions",),
                            kwargs={"json": {"model": "fake-model", "prompt": system + "HOLD", "max_tokens": 5},
                                    "timeout": 30}, daemon=True)
    held.start()
    deadline = time.monotonic() + 10
    while sum(d.in_flight for d in decodes) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    busy = next(d for d in decodes if d.in_flight)
    # In this mode vllm-router's least-load choice reads the servers' polled /get_load, not its own count
    busy.wait_load_polled()
    for i in range(4):  # the other decode instance has nothing in flight: it takes them all
        r = httpx.post(router.url + "/v1/completions", timeout=30,
                       json={"model": "fake-model", "prompt": system + f"question {i}", "max_tokens": 5})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] != f"from {busy.name}"
    for d in decodes:
        d.hold.set()
    held.join(10)
    # the five requests share their prefix: one prefill instance saw them all
    assert sorted(len(p.completions()) for p in prefills) == [0, 5]


def test_a_failed_prefill_is_an_error_not_a_decode_without_kv(fake_workers, start_router):
    router, (p,), (d,) = pd_pair(fake_workers, start_router)
    p.stop()
    r = httpx.post(router.url + "/v1/completions", timeout=30,
                   json={"model": "fake-model", "prompt": "hello", "max_tokens": 5})
    assert r.status_code >= 500
    assert d.completions() == []
