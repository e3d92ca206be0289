"""`splitserve serve --speculative-config` (n-gram): 32 concurrent streamed greedy chats (over 8 sequence
slots) give the same text as a server without speculation, drafts are accepted (/metrics, both metric names)."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.e2e.conftest import DEFAULT_ARGS, ServerProcess, metric_value

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
SERVER_ARGS = ["--speculative-config", json.dumps(NGRAM), "--metrics-compat", "vllm"]
TEXT = "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat"
CHATS = [[{"role": "user", "content": f"Repeat exactly, {i + 1} time(s): '{TEXT}'"}] for i in range(32)]


@pytest.fixture(scope="module")
def plain_server(_servers):
    """A server without speculation (shared with modules that ask for the default flags)."""
    args = tuple(DEFAULT_ARGS)
    srv = _servers.get(args)
    if srv is None or srv.proc.poll() is not None:
        srv = _servers[args] = ServerProcess(list(args))
        srv.wait_healthy()
    return srv


def stream_all(url: str) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)

    def one(messages):
        chunks = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=40,
                                                temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    with ThreadPoolExecutor(len(CHATS)) as pool:
        return list(pool.map(one, CHATS))


def test_streams_equal_speculation_off(server, plain_server):
    import httpx
    spec_texts = stream_all(server.url)
    assert spec_texts == stream_all(plain_server.url)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    accepted = metric_value(text, "splitserve:spec_decode_num_accepted_tokens_total")
    assert accepted and accepted > 0
    assert metric_value(text, "vllm:spec_decode_num_accepted_tokens_total") == accepted
    assert metric_value(text, "vllm:spec_decode_num_draft_tokens_total") >= accepted
