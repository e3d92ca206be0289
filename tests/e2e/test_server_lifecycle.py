"""API key, a full queue, and SIGTERM draining, on a server of its own (the last test stops it).

One running sequence at a time and one waiting make the queue easy to fill on purpose.
"""
from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from conftest import metric_value

KEY = "sekret-test-key"
DRAIN_S = 10.0  # the short request (20 tokens) must finish inside it on a loaded 2-core machine
SERVER_ARGS = ["--api-key", KEY, "--max-num-seqs", "1", "--max-queued-requests", "1",
               "--drain-timeout", str(DRAIN_S), "--served-model-name", "smol"]
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def srv(own_server):
    return own_server


def metric(srv, name: str, **labels) -> float | None:
    return metric_value(httpx.get(srv.url + "/metrics", timeout=10).text, name, labels)


def wait_for(cond, timeout=20.0, what=""):
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Streamer(threading.Thread):
    """Streams one request in the background, keeping every data payload."""

    def __init__(self, srv, body: dict):
        super().__init__(daemon=True)
        self.srv, self.body, self.events, self.error, self.status = srv, body, [], None, None
        self.stop = threading.Event()

    def run(self):
        try:
            with httpx.stream("POST", self.srv.url + "/v1/completions", json=self.body, headers=AUTH,
                              timeout=60) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: "):])
                    if self.stop.is_set():
                        return
        except httpx.HTTPError as e:
            self.error = e


def test_api_key(srv):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/chat/completions", CHAT),
                                   ("POST", "/tokenize", {"prompt": "x"})):
            r = httpx.request(method, srv.url + path, json=body, headers=headers, timeout=60)
            assert r.status_code == 401, (path, headers, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
    assert httpx.get(srv.url + "/v1/models", headers=AUTH).json()["data"][0]["id"] == "smol"
    r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "smol"
    # the served name replaces the model's own; the old one is unknown now
    r = httpx.post(srv.url + "/v1/chat/completions", json={**CHAT, "model": "SmolLM2-135M-Instruct"},
                   headers=AUTH, timeout=60)
    assert r.status_code == 404
    # health, metrics and the chat page stay open for probes and browsers
    for path in ("/health", "/metrics", "/", "/version"):
        assert httpx.get(srv.url + path).status_code == 200, path


def test_full_queue_gets_503_then_recovers(srv):
    long = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    running, queued = Streamer(srv, long), Streamer(srv, long)
    running.start()
    wait_for(lambda: len(running.events) >= 1, what="the first request to run")
    queued.start()
    wait_for(lambda: metric(srv, "splitserve:num_requests_waiting") == 1, what="the second request to wait")
    r = httpx.post(srv.url + "/v1/completions", json={**long, "stream": False}, headers=AUTH, timeout=60)
    assert r.status_code == 503
    assert int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "max-queued-requests" in err["message"]
    running.stop.set()
    queued.stop.set()
    running.join(30)
    queued.join(30)
    wait_for(lambda: metric(srv, "splitserve:num_requests_running") == 0
             and metric(srv, "splitserve:num_requests_waiting") == 0
             and metric(srv, "splitserve:kv_cache_usage_perc") == 0, what="the server to be idle")
    r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, headers=AUTH, timeout=60)
    assert r.status_code == 200


def test_sigterm_drains_then_exits(srv):
    """In flight at SIGTERM: a short request (finishes normally) and a long queued one (cut off at
    the drain timeout). No new connections are accepted; the process exits with status 0."""
    short = Streamer(srv, {"model": "smol", "prompt": "Hello", "max_tokens": 20, "ignore_eos": True,
                           "temperature": 0, "stream": True})
    long = Streamer(srv, {"model": "smol", "prompt": "Hello", "max_tokens": 1000, "ignore_eos": True,
                          "stream": True})
    short.start()
    wait_for(lambda: len(short.events) >= 1, what="the short request to start")
    long.start()
    wait_for(lambda: metric(srv, "splitserve:num_requests_waiting") == 1, what="the long request to queue")
    sent = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/health", timeout=5)
    short.join(30)
    assert short.error is None and short.events[-1] == "[DONE]"
    assert '"finish_reason":"length"' in short.events[-2]
    rc = srv.proc.wait(timeout=DRAIN_S + 20)
    elapsed = time.monotonic() - sent
    assert rc == 0, srv.log_tail()
    assert DRAIN_S - 1 < elapsed < DRAIN_S + 10, elapsed
    long.join(10)
    # cut off at the drain timeout, cleanly: aborted, and the stream still ends with [DONE]
    assert long.error is None and long.events[-1] == "[DONE]"
    assert '"finish_reason":"abort"' in long.events[-2]
    log = srv.log_tail(200)
    assert "draining" in log and "aborted 1 request" in log and "Traceback" not in log, log
