"""Helpers of the reliability tests: a server per test on the tiny model, an asyncio streaming client
that can walk away at any moment, and /metrics readings."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx

from conftest import ServerProcess, metric_value

# Every stream and call of these tests is bounded; nothing can hang the suite.
CALL_TIMEOUT_S = 120.0
TINY_ARGS = ["--max-model-len", "512", "--disable-access-log", "--served-model-name", "tiny"]


@contextlib.contextmanager
def running_server(model_dir: str, args: list[str], env: dict[str, str] | None = None):
    srv = ServerProcess([model_dir, *TINY_ARGS, *args], env=env)
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def metric(url: str, name: str, **labels) -> float | None:
    return metric_value(httpx.get(url + "/metrics", timeout=10).text, name, labels)


def wait_idle(url: str, timeout: float = 30.0) -> None:
    """Waits until nothing runs or waits and every KV block is back (fails after timeout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (metric(url, "splitserve:num_requests_running") == 0 and metric(url, "splitserve:num_requests_waiting") == 0
                and metric(url, "splitserve:kv_cache_usage_perc") == 0):
            return
        time.sleep(0.05)
    raise AssertionError(f"server not idle after {timeout}s: running={metric(url, 'splitserve:num_requests_running')} "
                         f"waiting={metric(url, 'splitserve:num_requests_waiting')} "
                         f"kv={metric(url, 'splitserve:kv_cache_usage_perc')}")


class StreamResult:
    def __init__(self):
        self.status: int | None = None
        self.headers: dict = {}
        self.text = ""
        self.finish_reason: str | None = None
        self.error: dict | None = None      # an in-band error event
        self.done = False                   # saw data: [DONE]
        self.chunks = 0                     # data events with text
        self.body: dict | None = None       # the JSON body of a non-200 answer


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict, leave_after_chunks: int | None = None
                            ) -> StreamResult:
    """Streams one completion and gathers its text. With leave_after_chunks=k the client closes the
    connection after k text chunks (k=0: right after the headers), mid-stream."""
    res = StreamResult()
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                             timeout=CALL_TIMEOUT_S) as r:
        res.status, res.headers = r.status_code, dict(r.headers)
        if r.status_code != 200:
            res.body = json.loads(await r.aread())
            return res
        if leave_after_chunks == 0:
            return res
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                res.done = True
                break
            event = json.loads(payload)
            if "error" in event:
                res.error = event["error"]
                continue
            for choice in event["choices"]:
                res.text += choice["text"]
                res.chunks += bool(choice["text"])
                if choice["finish_reason"] is not None:
                    res.finish_reason = choice["finish_reason"]
            if leave_after_chunks is not None and res.chunks >= leave_after_chunks:
                return res
    return res


async def gather_bounded(coros, limit: int) -> list:
    """Runs coroutines with at most `limit` at a time; results in order, exceptions returned."""
    sem = asyncio.Semaphore(limit)

    async def one(c):
        async with sem:
            return await c

    return await asyncio.gather(*(one(c) for c in coros), return_exceptions=True)
