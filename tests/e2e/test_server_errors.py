"""Bad input gets its status and the OpenAI error shape (never a 500, never FastAPI's 422), the
server keeps serving afterwards, a client that disconnects frees its request, and /metrics, the
tokenizer endpoints and the chat page work. Shares its server with test_server_openai.py."""
from __future__ import annotations

import time

import httpx
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
OK_COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


def assert_error(r: httpx.Response, status: int, param: str | None = "any", contains: str = "") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    if param != "any":
        assert err["param"] == param, err
    assert contains in err["message"], err
    return err


BAD_COMPLETIONS = [
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -5}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"n": 0}, "n"),
    ({"n": 100000}, "n"),
    ({"logprobs": 50}, "logprobs"),
    ({"seed": 2 ** 70}, "seed"),
    ({"seed": "x"}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 2, 10 ** 9]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [["a"], 3]}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"logit_bias": {"1": 500}}, "logit_bias"),
    ({"logit_bias": {"x": 5}}, "logit_bias"),
    ({"stream": "sometimes"}, "stream"),
]


@pytest.mark.parametrize("patch,param", BAD_COMPLETIONS, ids=[f"{k}" for k, _ in BAD_COMPLETIONS])
def test_bad_completion_params(server, patch, param):
    r = httpx.post(server.url + "/v1/completions", json={**OK_COMPLETION, **patch}, timeout=60)
    assert_error(r, 400, param)


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]}, None),
    ({"max_completion_tokens": -2}, "max_tokens"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # auto needs --enable-auto-tool-choice
]


@pytest.mark.parametrize("patch,param", BAD_CHATS, ids=[f"{k}" for k, _ in BAD_CHATS])
def test_bad_chat_params(server, patch, param):
    r = httpx.post(server.url + "/v1/chat/completions", json={**OK_CHAT, **patch}, timeout=60)
    err = assert_error(r, 400)
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param), err


def test_context_overflow_says_the_numbers(server):
    r = httpx.post(server.url + "/v1/completions", json={**OK_COMPLETION, "max_tokens": 2048}, timeout=60)
    err = assert_error(r, 400, "max_tokens", contains="2048")
    assert "2049" in err["message"] and "(1 tokens)" in err["message"]
    long_prompt = "hello " * 2500
    r = httpx.post(server.url + "/v1/completions", json={**OK_COMPLETION, "prompt": long_prompt}, timeout=60)
    assert_error(r, 400, "prompt", contains="2048")
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={**OK_CHAT, "messages": [{"role": "user", "content": long_prompt}]}, timeout=60)
    assert_error(r, 400, contains="2048")


def test_malformed_bodies(server):
    for content in (b"{not json", b"[1, 2]", b"", b'{"prompt": "x", "temperature": NaN}',
                    b'{"prompt": "x", "top_p": Infinity}'):
        r = httpx.post(server.url + "/v1/completions", content=content,
                       headers={"content-type": "application/json"}, timeout=60)
        assert_error(r, 400)


def test_unknown_model_and_routes(server):
    for path, body in (("/v1/completions", OK_COMPLETION), ("/v1/chat/completions", OK_CHAT)):
        err = assert_error(httpx.post(server.url + path, json={**body, "model": "gpt-17"}), 404, "model")
        assert err["code"] == "model_not_found"
    assert_error(httpx.post(server.url + "/tokenize", json={"model": "gpt-17", "prompt": "x"}), 404, "model")
    assert_error(httpx.get(server.url + "/v1/nothing-here"), 404)
    assert_error(httpx.get(server.url + "/v1/completions"), 405)


def test_openai_client_sees_typed_errors(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=5000)
    assert "5000" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_server_keeps_serving_after_bad_input(server):
    r = httpx.post(server.url + "/v1/completions", json=OK_COMPLETION, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(server.url + "/health").status_code == 200


def wait_idle(metric, timeout=15.0) -> float:
    """Seconds until no request runs or waits and the KV cache is empty (fails after timeout)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if (metric("splitserve:num_requests_running") == 0 and metric("splitserve:num_requests_waiting") == 0
                and metric("splitserve:kv_cache_usage_perc") == 0):
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"not idle after {timeout}s: running={metric('splitserve:num_requests_running')} "
                         f"kv={metric('splitserve:kv_cache_usage_perc')}")


def test_disconnect_mid_stream_frees_the_request(server, metric):
    aborted = metric("splitserve:request_success_total", finished_reason="abort")
    body = {**OK_CHAT, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == 4:
                break
    # mid-generation, the request held KV blocks; after the client left they are all back
    wait_idle(metric)
    assert metric("splitserve:request_success_total", finished_reason="abort") == aborted + 1


def test_disconnect_while_waiting_for_plain_response(server, metric):
    aborted = metric("splitserve:request_success_total", finished_reason="abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions",
                   json={**OK_COMPLETION, "max_tokens": 1000, "ignore_eos": True}, timeout=1.5)
    wait_idle(metric)
    assert metric("splitserve:request_success_total", finished_reason="abort") == aborted + 1


def test_metrics(server, metric):
    before = {n: metric(n) for n in ("splitserve:prompt_tokens_total", "splitserve:generation_tokens_total",
                                     "splitserve:time_to_first_token_seconds_count",
                                     "splitserve:e2e_request_latency_seconds_count",
                                     "splitserve:inter_token_latency_seconds_count",
                                     "splitserve:request_queue_time_seconds_count",
                                     "splitserve:prefix_cache_queries_total")}
    length = metric("splitserve:request_success_total", finished_reason="length")
    r = httpx.post(server.url + "/v1/completions", json={**OK_COMPLETION, "max_tokens": 3, "ignore_eos": True},
                   timeout=60).json()
    after = {n: metric(n) for n in before}
    assert after["splitserve:prompt_tokens_total"] - before["splitserve:prompt_tokens_total"] \
        == r["usage"]["prompt_tokens"]
    assert after["splitserve:generation_tokens_total"] - before["splitserve:generation_tokens_total"] == 3
    for n in ("time_to_first_token_seconds_count", "e2e_request_latency_seconds_count",
              "request_queue_time_seconds_count"):
        assert after[f"splitserve:{n}"] == before[f"splitserve:{n}"] + 1
    assert after["splitserve:inter_token_latency_seconds_count"] == \
        before["splitserve:inter_token_latency_seconds_count"] + 2
    assert after["splitserve:prefix_cache_queries_total"] > before["splitserve:prefix_cache_queries_total"]
    assert metric("splitserve:request_success_total", finished_reason="length") == length + 1
    text = httpx.get(server.url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_hits_total", "num_preemptions_total"):
        assert metric(f"splitserve:{name}") is not None, name
    assert "# TYPE splitserve:time_to_first_token_seconds histogram" in text
    assert 'splitserve:request_success_total{finished_reason="stop"' in text


def test_tokenize_detokenize(server):
    t = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] == 2048
    assert httpx.post(server.url + "/detokenize", json={"tokens": t["tokens"]}).json()["prompt"] == "Hello world"
    chat = httpx.post(server.url + "/tokenize", json={"messages": OK_CHAT["messages"]}).json()
    assert chat["count"] > t["count"]
    assert_error(httpx.post(server.url + "/detokenize", json={"tokens": [10 ** 9]}), 400, "tokens")
    assert_error(httpx.post(server.url + "/tokenize", json={}), 400)


def test_chat_page(server):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert "<textarea" in page and "/v1/chat/completions" in page and "Clear" in page
    # self-contained: no scripts, styles or fonts from elsewhere
    assert "http://" not in page and "https://" not in page and "src=" not in page
