"""`splitserve serve` runs the engine core in a process of its own. The process tree, both ways of
losing a process (SIGKILL of the core, SIGKILL of the server), one event per token for 64 concurrent
streams, and a client that disconnects being aborted in the core."""
from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import psutil
import pytest

from reliability_support import CALL_TIMEOUT_S, gather_bounded, metric, running_server, wait_idle

STREAMS = 64
TOKENS = 12


def core_process(server_pid: int) -> psutil.Process:
    """The engine core: the server's child started by multiprocessing's spawn (not its resource tracker)."""
    for child in psutil.Process(server_pid).children():
        cmdline = " ".join(child.cmdline())
        if "spawn_main" in cmdline:
            return child
    raise AssertionError(f"no engine core process under {server_pid}: "
                         f"{[' '.join(c.cmdline()) for c in psutil.Process(server_pid).children()]}")


@pytest.fixture(scope="module")
def srv(tiny_model_dir):
    with running_server(tiny_model_dir, ["--max-num-seqs", str(STREAMS)]) as s:
        yield s


def test_the_core_runs_in_a_child_process(srv):
    core = core_process(srv.proc.pid)
    assert core.is_running() and core.pid != srv.proc.pid and core.ppid() == srv.proc.pid
    # the model runs there: it has the torch threads and the model's memory, and it serves
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=CALL_TIMEOUT_S)
    assert r.status_code == 200 and core.is_running()


async def _stream_events(client: httpx.AsyncClient, url: str, i: int) -> list[dict]:
    body = {"prompt": f"Story {i}:", "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0,
            "logprobs": 0, "stream": True, "stream_options": {"include_usage": True}}
    events = []
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=CALL_TIMEOUT_S) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_64_concurrent_streams_get_one_event_per_token(srv):
    async def main():
        async with httpx.AsyncClient() as client:
            return await gather_bounded([_stream_events(client, srv.url, i) for i in range(STREAMS)], STREAMS)
    results = asyncio.run(main())
    for events in results:
        assert not isinstance(events, BaseException), events
        token_events = [e for e in events if e["choices"]]
        usage = [e["usage"] for e in events if not e["choices"]]
        # every event with a choice carries exactly one token (its logprobs list the tokens it carries)
        assert [len(e["choices"][0]["logprobs"]["tokens"]) for e in token_events] == [1] * TOKENS
        assert usage and usage[-1]["completion_tokens"] == TOKENS
        assert token_events[-1]["choices"][0]["finish_reason"] == "length"
    wait_idle(srv.url)


def test_a_client_that_disconnects_is_aborted_in_the_core(srv):
    def finished(reason: str) -> float:
        return metric(srv.url, "splitserve:request_success_total", finished_reason=reason)
    aborted, completed = finished("abort"), finished("length")
    body = {"prompt": "Once", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=CALL_TIMEOUT_S) as r:
        for n, line in enumerate(r.iter_lines()):
            if n >= 6:
                break  # walk away mid-stream
    wait_idle(srv.url, timeout=20)  # the core dropped it and every block is back
    assert finished("abort") == aborted + 1 and finished("length") == completed


def test_sigkill_of_the_core_fails_requests_and_the_server_exits(tiny_model_dir):
    with running_server(tiny_model_dir, []) as srv:
        core = core_process(srv.proc.pid)
        body = {"prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}
        lines: list[str] = []
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=CALL_TIMEOUT_S) as r:
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 4:
                    core.send_signal(signal.SIGKILL)
            # the stream ends cleanly: an in-band error naming the cause, then [DONE]
        errors = [json.loads(x[6:])["error"] for x in lines if x.startswith("data: {") and '"error"' in x]
        assert errors and "engine core process died" in errors[0]["message"], lines[-3:]
        assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
        health = httpx.get(srv.url + "/health", timeout=10)
        assert health.status_code == 503 and "engine core process died" in health.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503
        assert srv.proc.wait(timeout=30) != 0


def test_sigkill_of_the_server_ends_the_core(tiny_model_dir):
    with running_server(tiny_model_dir, []) as srv:
        core = core_process(srv.proc.pid)
        srv.proc.send_signal(signal.SIGKILL)
        started = time.monotonic()
        gone, alive = psutil.wait_procs([core], timeout=5)
        assert core in gone and not alive, f"the engine core outlived its server by {time.monotonic() - started:.1f} s"
