"""Helpers for the router tests: OpenAI-shaped fake workers on threads of the test process, and the
`splitserve router` process (started by PID, stopped by PID).

A fake worker records every request it is sent (path, JSON body, headers), answers from its name so a
test sees which worker served, streams its chunks with a delay so a test sees them arrive one by one,
and can be told to fail its health check or to hold requests until released.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zlib

import httpx
import pytest

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tests.e2e.conftest import free_port

# The modules that start the router skip themselves without it; the launcher's own tests do not need it.
NEEDS_ROUTER = pytest.mark.skipif(importlib.util.find_spec("vllm_router") is None,
                                  reason="needs vllm-router (pip install 'splitserve[router]')")

ROUTER_START_TIMEOUT_S = 30


class FakeWorker:
    """A fake OpenAI-compatible server. `prefill=True` answers as a prefill instance of vLLM's
    disaggregated protocol: it returns `kv_transfer_params` naming itself and the request."""

    def __init__(self, name: str, model: str = "fake-model", chunks: int = 5, chunk_delay_s: float = 0.0,
                 prefill: bool = False):
        self.name, self.model, self.chunks, self.chunk_delay_s, self.prefill = name, model, chunks, chunk_delay_s, prefill
        self.healthy = True
        self.requests: list[dict] = []      # {"path", "body", "headers"} of every completion request
        self.in_flight = 0
        self.tokenize_calls = 0
        self.load_polls = 0
        self.hold = threading.Event()       # cleared: requests whose prompt ends with "HOLD" wait for it
        self.hold.set()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self._app(), host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, f"fake worker {name} did not start"
            time.sleep(0.02)

    def wait_load_polled(self, timeout: float = 15) -> None:
        """Until the router has read this worker's /get_load once more (it polls every few seconds)."""
        seen, deadline = self.load_polls, time.monotonic() + timeout
        while self.load_polls <= seen:
            assert time.monotonic() < deadline, f"the router never polled {self.name}'s /get_load"
            time.sleep(0.05)
        time.sleep(0.2)  # and has stored what it read

    def completions(self, path: str | None = None) -> list[dict]:
        return [r for r in self.requests if path is None or r["path"] == path]

    def stop(self) -> None:
        self.hold.set()
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def _kv_params(self, n: int) -> dict:
        # What a prefill instance hands the decode instance (vLLM's NixlConnector fields); unique per request.
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": f"{self.name}-engine",
                "remote_block_ids": [n, n + 1, n + 2], "remote_host": "127.0.0.1", "remote_port": 5600 + n,
                "remote_request_id": f"{self.name}-{n}", "tp_size": 1}

    def _app(self) -> FastAPI:
        app = FastAPI()

        async def complete(request: Request):
            body = await request.json()
            record = {"path": request.url.path, "body": body, "headers": dict(request.headers)}
            self.requests.append(record)
            n = len(self.requests)
            chat = request.url.path.endswith("/chat/completions")
            prompt = body["messages"][-1]["content"] if chat else body.get("prompt", "")
            self.in_flight += 1
            try:
                if prompt.endswith("HOLD"):
                    await asyncio.to_thread(self.hold.wait, 30)
                if body.get("stream"):
                    return StreamingResponse(self._stream(chat, n), media_type="text/event-stream")
                text = f"from {self.name}"
                out = {"id": f"{self.name}-{n}", "object": "chat.completion" if chat else "text_completion",
                       "created": 1, "model": self.model,
                       "choices": [{"index": 0, "finish_reason": "length",
                                    **({"message": {"role": "assistant", "content": text}} if chat else {"text": text})}],
                       "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
                kv = body.get("kv_transfer_params")
                if self.prefill and kv and kv.get("do_remote_decode"):
                    out["kv_transfer_params"] = record["returned_kv"] = self._kv_params(n)
                return JSONResponse(out)
            finally:
                self.in_flight -= 1

        app.add_api_route("/v1/completions", complete, methods=["POST"])
        app.add_api_route("/v1/chat/completions", complete, methods=["POST"])

        @app.get("/health")
        async def health():
            return JSONResponse({}, status_code=200 if self.healthy else 503)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 1, "owned_by": self.name}]}

        @app.post("/tokenize")  # splitserve's answer shape; vllm-router's cache_aware matches on these ids
        async def tokenize(request: Request):
            body = await request.json()
            self.tokenize_calls += 1
            text = body.get("prompt") or json.dumps(body.get("messages"))
            tokens = [zlib.crc32(word.encode()) % 49152 for word in text.split()]  # a word is a token
            return {"count": len(tokens), "max_model_len": 2048, "tokens": tokens}

        @app.get("/get_load")  # what vllm-router polls for its least-load choices (splitserve answers it too)
        async def get_load():
            self.load_polls += 1
            return {"load": self.in_flight}

        return app

    async def _stream(self, chat: bool, n: int):
        for i in range(self.chunks):
            if i:
                await asyncio.sleep(self.chunk_delay_s)
            piece = f"{self.name}:{i} "
            choice = {"index": 0, "finish_reason": None,
                      **({"delta": {"content": piece}} if chat else {"text": piece})}
            chunk = {"id": f"{self.name}-{n}", "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": 1, "model": self.model, "choices": [choice]}
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"


class RouterProcess:
    """`python -m splitserve router ...` on free ports; ready when /workers counts `expect_healthy` healthy workers."""

    def __init__(self, args: list[str], expect_healthy: int | None = None):
        self.port, self.metrics_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="splitserve-router-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "splitserve", "router", "--port", str(self.port),
               "--metrics-port", str(self.metrics_port), "--health-check-interval-s", "1",
               "--health-failure-threshold", "1", "--log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self.wait_healthy(expect_healthy)
        except BaseException:
            self.stop()  # the caller never gets this object to stop: do not leave the router running
            raise

    def log_tail(self, n: int = 30) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return "".join(f.readlines()[-n:])

    def healthy_workers(self) -> int:
        """How many workers (of any kind: plain, prefill, decode) the router counts as healthy now."""
        workers = httpx.get(self.url + "/workers", timeout=5).json()["workers"]
        return sum(w["is_healthy"] for w in workers)

    def wait_healthy(self, count: int | None, timeout: float = ROUTER_START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/liveness", timeout=2).status_code == 200 and (
                        count is None or self.healthy_workers() == count):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"router not ready with {count} healthy workers after {timeout}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.log.closed:
            self.log.close()
            os.unlink(self.log.name)


@pytest.fixture
def fake_workers():
    """make(name, **kw) → a FakeWorker; every one is stopped at the end of the test."""
    made: list[FakeWorker] = []

    def make(name: str, **kw) -> FakeWorker:
        made.append(FakeWorker(name, **kw))
        return made[-1]
    yield make
    for w in made:
        w.stop()


@pytest.fixture
def start_router():
    """start_router(args, expect_healthy) → a RouterProcess; each is stopped (by PID) at the end of the test."""
    made: list[RouterProcess] = []

    def start(args: list[str], expect_healthy: int | None = None) -> RouterProcess:
        made.append(RouterProcess(args, expect_healthy))
        return made[-1]
    yield start
    for r in made:
        r.stop()
