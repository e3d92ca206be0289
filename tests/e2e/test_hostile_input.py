"""Hostile input never gets a 5xx and never hangs the server.

Two parts on one tiny-model server: schemathesis fuzzes every endpoint of the server's own OpenAPI
schema (valid and invalid bodies, a bounded number of cases), and hand-written cases cover what a
generator rarely hits: malformed JSON, invalid UTF-8, lone surrogate escapes, control characters,
bodies over the size cap (413), huge numbers, out-of-vocabulary ids, prompts of special tokens only.
After each part the server must be healthy and idle, with every KV block back.
"""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from reliability_support import CALL_TIMEOUT_S, running_server, wait_idle

BODY_CAP = 64 * 1024
# A short context bounds the work of any generated request (max_tokens <= 63, n <= 128).
SERVER_FLAGS = ["--max-model-len", "64", "--max-request-body-bytes", str(BODY_CAP), "--max-num-seqs", "16"]
FUZZ_CASES = 60  # per operation and mode


@pytest.fixture(scope="module")
def srv(tiny_model_dir):
    with running_server(tiny_model_dir, SERVER_FLAGS) as s:
        yield s


# Every operation of the schema; the first test fails if the server grows one not listed here.
OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
              ("POST", "/detokenize"), ("GET", "/v1/models"), ("GET", "/health"), ("GET", "/metrics"),
              ("GET", "/version"), ("GET", "/"), ("GET", "/v1/models/{model_id}"), ("GET", "/ping"),
              ("POST", "/ping"), ("GET", "/load"), ("GET", "/get_load"), ("POST", "/v1/load_lora_adapter"),
              ("POST", "/v1/unload_lora_adapter")]
# Negative cases (schema violations) exist only where there is a body to break.
CASES = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + \
        [(m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if m == "POST" and p != "/ping"]
fuzzed: dict[str, int] = {}


@pytest.fixture(scope="module")
def api_schema(srv):
    return schemathesis.openapi.from_url(srv.url + "/openapi.json")


def test_schema_lists_exactly_the_fuzzed_operations(api_schema):
    listed = {(op.method.upper(), op.path) for op in (r.ok() for r in api_schema.get_all_operations())}
    assert listed == set(OPERATIONS)


@pytest.mark.parametrize("method,path,mode", CASES, ids=[f"{m} {p} {g.value}" for m, p, g in CASES])
def test_fuzz(api_schema, srv, method, path, mode):
    """Valid (positive) and schema-violating (negative) cases: any answer but a 5xx, within the
    timeout. Derandomized, so a failure reproduces."""
    operation = api_schema[path][method.lower()]

    @settings(max_examples=FUZZ_CASES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        response = case.call(base_url=srv.url, timeout=CALL_TIMEOUT_S)
        fuzzed[f"{method} {path}"] = fuzzed.get(f"{method} {path}", 0) + 1  # (a hang fails by timeout)
        assert response.status_code < 500, (case.body, case.query, response.status_code, response.text[:500])

    run()


def test_fuzzing_left_the_server_healthy_and_idle(srv):
    print(f"fuzzed {sum(fuzzed.values())} cases: {fuzzed}")
    assert len(fuzzed) == len(OPERATIONS) and sum(fuzzed.values()) >= len(CASES) * 5, fuzzed
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    wait_idle(srv.url)


# (path, raw body, expected): "4xx" must be refused with an OpenAI-shaped error, "2xx" served.
C, CHAT = "/v1/completions", "/v1/chat/completions"
RAW_CASES = [
    (C, b"{not json", "4xx"), (C, b"", "4xx"), (C, b"[]", "4xx"), (C, b"null", "4xx"), (C, b"42", "4xx"),
    (C, b'"prompt"', "4xx"), (C, b"[" * 5000, "4xx"), (C, b'{"prompt": "x", "max_tokens": 1e999}', "4xx"),
    (C, b'{"prompt": "\xff\xfe\xfa not utf-8", "max_tokens": 2}', "4xx"),      # invalid UTF-8 bytes
    (C, b'{"prompt": "\\ud800 lone surrogate", "max_tokens": 2}', "4xx"),       # valid JSON, invalid Unicode
    (C, b'{"prompt": ["x", "\\udfff"], "max_tokens": 2}', "4xx"),
    (C, b'{"prompt": "x", "stop": ["\\ud83d"], "max_tokens": 2}', "4xx"),
    (C, b'{"prompt": {"nested": {"deep": [1, 2, {"x": null}]}}}', "4xx"),
    (C, b'{"prompt": "x", "max_tokens": 2, "n": 99999999999999999999999999999}', "4xx"),
    (C, b'{"prompt": "x", "max_tokens": 99999999999999999999999999999999999999}', "4xx"),
    (C, b'{"prompt": "x", "max_tokens": -99999999999999999999999999999999999999}', "4xx"),
    (C, b'{"prompt": [1, 2, 99999999999999999999999999999]}', "4xx"),
    (C, b'{"prompt": "x", "max_tokens": 2, "stop_token_ids": [99999999999999999999999999]}', "2xx"),  # never sampled
    (C, b'{"prompt": "x", "max_tokens": 2, "temperature": 1e308, "top_p": 1e-320}', "2xx"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', "4xx"),
    (CHAT, b'{"messages": [{"role": "\\udc00", "content": "x"}], "max_tokens": 2}', "4xx"),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}], "max_tokens": 2}', "4xx"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"\\ud800": 1}}', "4xx"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tokenize": false}}', "4xx"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"conversation": 5}}', "4xx"),
    (CHAT, b'{"messages": [{"role": "nobody", "content": "x"}, {"role": "user", "content": 5}]}', "4xx"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\u0000\\u0001\\u001b[2J\\u007f\\u200b"}], "max_tokens": 2}', "2xx"),
    (CHAT, b'{"messages": [{"role": "user"}], "max_tokens": 2}', "2xx"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "4xx"), ("/detokenize", b'{"tokens": [-1]}', "4xx"),
    ("/detokenize", b'{"tokens": [99999999999999999999999]}', "4xx"),
]


@pytest.mark.parametrize("path,body,expected", RAW_CASES, ids=[f"{p} {b[:60]!r}" for p, b, _ in RAW_CASES])
def test_raw_bodies(srv, path, body, expected):
    r = httpx.post(srv.url + path, content=body, headers={"content-type": "application/json"}, timeout=CALL_TIMEOUT_S)
    if expected == "2xx":
        assert r.status_code == 200, (body, r.status_code, r.text)
        return
    assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


def test_control_characters_and_special_tokens_are_served(srv):
    specials = "<|endoftext|><|im_start|><|im_end|>" * 3
    for prompt in ("\x00\x01\x02\x1b[31m\x7f\u200b\ufeff", specials, [0, 0, 0, 1, 2], "\ud7ff\ue000\U0010ffff"):
        for stream in (False, True):
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "stream": stream,
                                                              "ignore_eos": True}, timeout=CALL_TIMEOUT_S)
            assert r.status_code == 200, (prompt, r.text)
            assert ("[DONE]" in r.text) if stream else r.json()["usage"]["completion_tokens"] == 4
    r = httpx.post(srv.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": specials}], "max_tokens": 3}, timeout=CALL_TIMEOUT_S)
    assert r.status_code == 200, r.text
    r = httpx.post(srv.url + "/tokenize", json={"prompt": specials, "add_special_tokens": False}, timeout=10)
    assert r.status_code == 200 and r.json()["count"] == 9


def test_oversized_bodies_get_413(srv):
    big = {"prompt": "x" * (BODY_CAP + 10), "max_tokens": 2}
    r = httpx.post(srv.url + "/v1/completions", json=big, timeout=CALL_TIMEOUT_S)
    assert r.status_code == 413, r.text
    assert "max-request-body-bytes" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: the cap must hold on the bytes received, too
        yield b'{"prompt": "'
        for _ in range(BODY_CAP // 1024 + 2):
            yield b"y" * 1024
        yield b'"}'

    r = httpx.post(srv.url + "/v1/completions", content=chunked(), headers={"content-type": "application/json"},
                   timeout=CALL_TIMEOUT_S)
    assert r.status_code == 413, r.text
    # just under the cap is parsed normally (here: too long for the context, a 400)
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x " * 20000, "max_tokens": 2}, timeout=CALL_TIMEOUT_S)
    assert r.status_code == 400 and "context" in r.json()["error"]["message"], r.text


def test_limits_on_numbers(srv):
    cases = [({"max_tokens": 10 ** 12}, "max_tokens"), ({"n": 129}, "n"), ({"n": 10 ** 40}, "n"),
             ({"prompt": [-1, 5]}, "prompt"), ({"prompt": [10 ** 6]}, "prompt"), ({"logprobs": 10 ** 9}, "logprobs"),
             ({"stop_token_ids": [-3]}, "stop_token_ids")]
    for patch, param in cases:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, **patch}, timeout=CALL_TIMEOUT_S)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (patch, r.text)


def test_still_healthy_and_idle_after_everything(srv):
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True},
                   timeout=CALL_TIMEOUT_S)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    wait_idle(srv.url)
