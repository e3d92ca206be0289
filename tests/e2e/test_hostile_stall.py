"""Hostile input never crashes a handler and never stalls the server's event loop.

One tiny-model server with the default body cap (32 MB), so neither kind of body is stopped by the
size cap (413) before reaching what is tested here:
- nesting: JSON nested at any depth in any field, on every endpoint that takes a body. Deeper than
  MAX_JSON_DEPTH it gets a 400 in the OpenAI error shape (it used to get a RecursionError, a 500);
  up to the limit it is handled as before.
- stall: a ~5 MB prompt or chat message takes seconds of CPU to tokenize. Meanwhile another client's
  stream must keep flowing: the largest gap between its events while the big request is handled
  must stay under STALL_LIMIT_S (tokenizing it on the event loop held every stream ~7 s).
After each part the server is healthy and idle, and its log holds no traceback.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from reliability_support import CALL_TIMEOUT_S, running_server, wait_idle
from splitserve.entrypoints.openai.body_limit import MAX_JSON_DEPTH

SERVER_FLAGS = ["--max-num-seqs", "8"]  # and TINY_ARGS: --max-model-len 512


@pytest.fixture(scope="module")
def srv(tiny_model_dir):
    with running_server(tiny_model_dir, SERVER_FLAGS) as s:
        yield s


def server_log(srv) -> str:
    with open(srv.log.name, errors="replace") as f:
        return f.read()


def assert_clean(srv) -> None:
    """Healthy, idle (every KV block back) and no unhandled exception logged."""
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    wait_idle(srv.url)
    log = server_log(srv)
    assert "Traceback" not in log and "unhandled error" not in log, log[-5000:]


def assert_openai_error(r: httpx.Response) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
    return err


# -- nesting ------------------------------------------------------------------------------------------
def nested(levels: int) -> str:
    """JSON text of arrays and objects, alternating, exactly `levels` deep (built as text: a value
    100000 deep would overflow json.dumps's recursion)."""
    kinds = ["[" if i % 2 else '{"a": ' for i in range(levels)]
    closes = ["]" if k == "[" else "}" for k in reversed(kinds)]
    return "".join(kinds) + '"x"' + "".join(closes)


C, CHAT, TOK = "/v1/completions", "/v1/chat/completions", "/tokenize"
MSG = '"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2'
# (field, path, body with @ where the nested value goes, status when shallow enough to be parsed)
NEST_CASES = [
    ("response_format", CHAT, '{' + MSG + ', "response_format": {"type": "text", "schema": @}}', 200),
    ("tools", CHAT, '{' + MSG + ', "tools": [{"type": "function", "function": {"name": "f", "parameters": @}}]}', 400),
    ("chat_template_kwargs", CHAT, '{' + MSG + ', "chat_template_kwargs": {"extra": @}}', 200),
    ("messages", CHAT, '{"max_tokens": 2, "messages": [{"role": "user", "content": '
                       '[{"type": "text", "text": "hi", "meta": @}]}]}', 200),
    ("messages", TOK, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "meta": @}]}]}', 200),
    ("prompt", C, '{"max_tokens": 2, "prompt": @}', 400),
    ("unknown_field", C, '{"prompt": "hi", "max_tokens": 2, "metadata": @}', 200),
]
DEPTHS = [10, MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 1000, 100_000]


def nest_body(template: str, depth: int) -> bytes:
    """The body with the nested value placed so that the whole document is `depth` deep."""
    prefix = template.split("@")[0]
    around = prefix.count("[") + prefix.count("{") - prefix.count("]") - prefix.count("}")
    return template.replace("@", nested(depth - around)).encode()


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("field,path,template,shallow_status", NEST_CASES,
                         ids=[f"{f}-{p.strip('/').replace('/', '_')}" for f, p, _, _ in NEST_CASES])
def test_nesting(srv, field, path, template, shallow_status, depth):
    body = nest_body(template, depth)
    if depth <= MAX_JSON_DEPTH + 1:  # the test's own check of its bodies
        value = json.loads(body)
        levels, todo = 0, [(value, 1)]
        while todo:
            v, d = todo.pop()
            levels = max(levels, d)
            todo.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v) if isinstance(c, (list, dict)))
        assert levels == depth
    r = httpx.post(srv.url + path, content=body, headers={"content-type": "application/json"}, timeout=CALL_TIMEOUT_S)
    if depth > MAX_JSON_DEPTH:
        assert r.status_code == 400, (field, depth, r.status_code, r.text[:500])
        err = assert_openai_error(r)
        assert err["code"] == "nesting_too_deep" and str(MAX_JSON_DEPTH) in err["message"], err
    else:
        assert r.status_code == shallow_status, (field, depth, r.status_code, r.text[:500])
        if r.status_code >= 400:
            assert_openai_error(r)


@pytest.mark.parametrize("field,path,template", [c[:3] for c in NEST_CASES],
                         ids=[f"{f}-{p.strip('/').replace('/', '_')}" for f, p, _, _ in NEST_CASES])
def test_nesting_near_the_recursion_limit(srv, field, path, template):
    """Every depth where parsing succeeds but a recursive walk after it (pydantic, our validators,
    the chat template) may hit Python's recursion limit of 1000: the window that gave 500s lies
    there, and where exactly depends on the stack depth at each walk."""
    statuses = {}
    with httpx.Client(timeout=CALL_TIMEOUT_S) as client:
        for depth in range(900, 1001):
            r = client.post(srv.url + path, content=nest_body(template, depth), headers={"content-type": "application/json"})
            statuses.setdefault(r.status_code, []).append(depth)
            if r.status_code == 400:
                assert assert_openai_error(r)["code"] == "nesting_too_deep", (depth, r.text[:500])
    assert set(statuses) == {400}, {k: v[:10] for k, v in statuses.items()}


def test_brackets_inside_strings_do_not_nest(srv):
    """Brackets in strings (after escaped quotes and backslashes too) are text, at any count."""
    for prompt in ("[{" * 200, '\\"' + "[" * 300, "\\" * 3 + "{" * 300, '"]}' * 100):
        r = httpx.post(srv.url + C, json={"prompt": prompt, "max_tokens": 2}, timeout=CALL_TIMEOUT_S)
        assert r.status_code == 200, (prompt[:20], r.text[:500])


def test_nesting_left_the_server_clean(srv):
    assert_clean(srv)


# -- stall --------------------------------------------------------------------------------------------
STALL_LIMIT_S = 0.5  # the bound on any other client's stream while a big request is handled
BIG = "x" * 5_000_000  # one 5 MB word: ~7 s of tokenizer CPU
BIG_REQUESTS = {
    "completion": (C, {"prompt": BIG, "max_tokens": 4}),
    "chat": (CHAT, {"messages": [{"role": "user", "content": BIG}], "max_tokens": 4}),
    "tokenize": (TOK, {"prompt": BIG}),
}


async def keep_streaming(client: httpx.AsyncClient, url: str, stop: asyncio.Event, times: list[float]) -> None:
    """Back-to-back streamed completions until stop; the arrival time of every SSE event."""
    body = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
    while not stop.is_set():
        async with client.stream("POST", url + C, json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    times.append(time.monotonic())
                if stop.is_set():
                    break


async def big_request_beside_a_stream(url: str, path: str, body: bytes) -> tuple[httpx.Response, float, float]:
    """Posts `body` while another client streams; returns the answer, how long it took, and the
    longest the stream went without an event meanwhile."""
    async with httpx.AsyncClient(timeout=CALL_TIMEOUT_S) as client:
        times: list[float] = []
        stop = asyncio.Event()
        streamer = asyncio.create_task(keep_streaming(client, url, stop, times))
        while len(times) < 5 and not streamer.done():  # the stream is flowing
            await asyncio.sleep(0.01)
        start = time.monotonic()
        r = await client.post(url + path, content=body, headers={"content-type": "application/json"})
        end = time.monotonic()
        stop.set()
        await streamer
    marks = [start] + [t for t in times if start < t < end] + [end]
    return r, end - start, max(b - a for a, b in zip(marks, marks[1:]))


@pytest.mark.parametrize("kind", list(BIG_REQUESTS))
def test_big_request_does_not_stall_other_streams(srv, kind):
    path, payload = BIG_REQUESTS[kind]
    body = json.dumps(payload).encode()  # encoded before the clock starts
    r, took, gap = asyncio.run(big_request_beside_a_stream(srv.url, path, body))
    print(f"{kind}: answered {r.status_code} in {took:.2f} s; longest gap in the other stream {gap:.3f} s")
    if kind == "tokenize":
        assert r.status_code == 200, r.text[:500]
        out = r.json()
        assert out["count"] == len(out["tokens"]) > 100_000
    else:
        assert r.status_code == 400, r.text[:500]
        assert "context" in assert_openai_error(r)["message"]
    assert gap <= STALL_LIMIT_S, f"another client's stream stalled {gap:.2f} s while the {kind} request ran"


def test_stall_left_the_server_clean(srv):
    assert_clean(srv)
