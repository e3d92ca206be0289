"""SIGTERM under load. With a drain timeout, every in-flight request — running or still queued —
finishes normally, new requests are refused, and the process exits 0. With a zero drain timeout the
in-flight requests end at once: streams with finish_reason "abort" and [DONE], plain requests 503."""
from __future__ import annotations

import asyncio
import signal
import threading
import time

import httpx

from reliability_support import CALL_TIMEOUT_S, gather_bounded, metric, running_server, stream_completion

IN_FLIGHT = 24


def start_load(srv, bodies: list[dict], plain: int = 0):
    """Runs the streams (and `plain` plain requests) in a background thread; returns (thread, results)."""
    results: list = []

    async def run():
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(bodies) + plain + 5)) as c:
            calls = [stream_completion(c, srv.url, b) for b in bodies]
            calls += [c.post(srv.url + "/v1/completions", json={**bodies[0], "stream": False}, timeout=CALL_TIMEOUT_S)
                      for _ in range(plain)]
            results.extend(await gather_bounded(calls, len(calls)))

    t = threading.Thread(target=asyncio.run, args=(run(),), daemon=True)
    t.start()
    return t, results


def wait_until(cond, timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def new_request_is_refused(srv) -> None:
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
    except httpx.TransportError:
        return  # the listening socket is closed: refused before any request
    assert r.status_code == 503 and r.headers.get("retry-after"), r.text


def test_sigterm_drains_all_in_flight_requests_then_exits_0(tiny_model_dir):
    with running_server(tiny_model_dir, ["--max-num-seqs", "8", "--drain-timeout", "60"]) as srv:
        body = {"prompt": "Once upon a time", "max_tokens": 60, "ignore_eos": True, "temperature": 0}
        thread, results = start_load(srv, [body] * IN_FLIGHT)
        # all in: 8 running, the rest queued
        wait_until(lambda: metric(srv.url, "splitserve:num_requests_waiting") >= IN_FLIGHT - 8 - 2, what="the queue")
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        new_request_is_refused(srv)
        thread.join(CALL_TIMEOUT_S)
        assert not thread.is_alive()
        assert srv.proc.wait(timeout=60) == 0, srv.log_tail()
        assert len(results) == IN_FLIGHT
        for res in results:
            assert not isinstance(res, BaseException), repr(res)
            assert res.status == 200 and res.done and res.error is None and res.finish_reason == "length", vars(res)
            assert res.chunks >= 30
        log = srv.log_tail(500)
        assert "draining" in log and "aborted" not in log and "Traceback" not in log, log


def test_sigterm_with_zero_drain_timeout_aborts_in_flight_requests(tiny_model_dir):
    with running_server(tiny_model_dir, ["--max-num-seqs", "4", "--drain-timeout", "0"]) as srv:
        body = {"prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True}
        thread, results = start_load(srv, [body] * 6, plain=2)
        wait_until(lambda: metric(srv.url, "splitserve:num_requests_running") == 4
                   and metric(srv.url, "splitserve:num_requests_waiting") == 4, what="the load")
        srv.proc.send_signal(signal.SIGTERM)
        thread.join(CALL_TIMEOUT_S)
        assert not thread.is_alive()
        assert srv.proc.wait(timeout=30) == 0, srv.log_tail()
        streams = [r for r in results if not isinstance(r, httpx.Response)]
        plains = [r for r in results if isinstance(r, httpx.Response)]
        assert len(streams) == 6 and len(plains) == 2, [repr(r) for r in results]
        for res in streams:
            assert not isinstance(res, BaseException), repr(res)
            assert res.status == 200 and res.done and res.finish_reason == "abort", vars(res)
        for r in plains:
            assert r.status_code == 503 and "aborted" in r.json()["error"]["message"], r.text
        assert "aborted 8 request" in srv.log_tail(500)
