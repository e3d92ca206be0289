"""The official `openai` client against a real `splitserve serve` process (default SmolLM2, CPU).

Outputs are kept short (a few tokens) because every token costs a CPU step. Greedy requests give
fixed text, so streamed and non-streamed results of the same request must agree exactly.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def sse_events(server, path: str, body: dict) -> list[str]:
    """The raw `data:` payloads of a streamed response, in order (to check the wire format)."""
    events = []
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    for block in raw.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            events.append(block[len("data: "):])
    return events


def test_models_version_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == 2048
    assert models.data[0].model_extra["quantization"] is None  # float weights
    assert httpx.get(server.url + "/version").json()["version"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_completion(server, client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert len(r.choices) == 1 and r.choices[0].text
    assert r.choices[0].finish_reason == "length"
    count = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()["count"]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (count, 6, count + 6)


def test_prompt_forms_agree(server, client):
    """Text, token ids, and a batch of prompts run the same request the same way."""
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == text.choices[0].text
    batch = client.completions.create(model=MODEL, prompt=[PROMPT, "One, two,"], max_tokens=4, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == text.choices[0].text
    assert batch.usage.completion_tokens == 8
    batch_ids = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=4, temperature=0)
    assert [c.text for c in batch_ids.choices] == [text.choices[0].text] * 2


def test_chat(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 8
    # max_completion_tokens is the newer name for max_tokens
    r2 = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=3, temperature=0)
    assert r2.usage.completion_tokens == 3 and msg.content.startswith(r2.choices[0].message.content)


def test_chat_stream_matches_non_stream(server, client):
    body = dict(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    full = client.chat.completions.create(**body)
    chunks = list(client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    # the usage chunk comes last, with no choices, and its totals are the non-streamed ones
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])

    # the wire format: data events, one finish_reason, usage chunk, then [DONE]
    events = sse_events(server, "/v1/chat/completions",
                        {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    assert all(p["object"] == "chat.completion.chunk" and p["id"] == parsed[0]["id"] for p in parsed)
    assert sum(1 for p in parsed for c in p["choices"] if c["finish_reason"]) == 1
    assert parsed[-1]["choices"] == [] and parsed[-1]["usage"]["total_tokens"] == full.usage.total_tokens


def test_completion_stream_n2(server):
    """n=2 streamed: each choice finishes exactly once; usage counts both choices' tokens."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "n": 2, "temperature": 1.0, "seed": 11,
            "ignore_eos": True, "logprobs": 0, "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events(server, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    finishes: dict[int, list] = {0: [], 1: []}
    texts, tokens = {0: "", 1: ""}, {0: 0, 1: 0}
    for p in parsed[:-1]:
        for c in p["choices"]:
            texts[c["index"]] += c["text"]
            tokens[c["index"]] += len((c["logprobs"] or {}).get("tokens", []))
            if c["finish_reason"]:
                finishes[c["index"]].append(c["finish_reason"])
    assert finishes == {0: ["length"], 1: ["length"]}
    assert tokens == {0: 5, 1: 5}
    usage = parsed[-1]["usage"]
    assert parsed[-1]["choices"] == [] and usage["completion_tokens"] == 10
    assert usage["total_tokens"] == usage["prompt_tokens"] + 10
    # the same seeded request without streaming gives the same texts
    plain = httpx.post(server.url + "/v1/completions", json={**body, "stream": False, "stream_options": None},
                       timeout=120).json()
    assert [c["text"] for c in plain["choices"]] == [texts[0], texts[1]]


def test_completion_stream_batch(server, client):
    """A batch of prompts streams as one response; choice i belongs to prompt i."""
    body = dict(model=MODEL, prompt=[PROMPT, "One, two,"], max_tokens=3, temperature=0)
    plain = client.completions.create(**body)
    events = sse_events(server, "/v1/completions", {**body, "stream": True})
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    assert len({p["created"] for p in parsed}) == 1 and len({p["id"] for p in parsed}) == 1
    texts, finishes = {0: "", 1: ""}, {0: [], 1: []}
    for p in parsed:
        for c in p["choices"]:
            texts[c["index"]] += c["text"]
            if c["finish_reason"]:
                finishes[c["index"]].append(c["finish_reason"])
    assert [texts[0], texts[1]] == [c.text for c in plain.choices]
    assert finishes == {0: [plain.choices[0].finish_reason], 1: [plain.choices[1].finish_reason]}


def test_n2(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=2, temperature=1.0, seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert 2 <= r.usage.completion_tokens <= 16
    assert r.choices[0].text != r.choices[1].text  # two samples, two derived seeds
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, n=2, temperature=1.0, seed=3)
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_stop_strings(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0).choices[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = " " + words[2]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stop=[stop, "zzzz"])
    c = r.choices[0]
    assert c.text == full[:full.index(stop)]
    assert c.finish_reason == "stop" and c.model_extra["stop_reason"] == stop
    # streamed, the stop string never leaks out either
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stop=stop,
                                         stream=True)
    chunks = list(streamed)
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason] == ["stop"]


def test_seeded_sampling_is_reproducible(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0,
                                         top_p=0.95, seed=seed, extra_body={"ignore_eos": True}).choices[0].text
    a, b, c = sample(1234), sample(1234), sample(99)
    assert a == b
    assert a != c
    chat = [client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0.9, seed=5,
                                           extra_body={"top_k": 50}).choices[0].message.content
            for _ in range(2)]
    assert chat[0] == chat[1]


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    c = r.choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens == 6
    assert "".join(lp.tokens) == c.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for tok, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0
        assert len(top) == 3  # greedy: the sampled token is one of the top 3
        assert top[tok] == pytest.approx(logprob)
        assert max(top.values()) == pytest.approx(logprob)  # greedy picks the most likely token


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.token == entry.top_logprobs[0].token and bytes(entry.bytes).decode() == entry.token
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None


def test_sampling_parameters_accepted(client):
    """Every vLLM-style knob goes through (effects are covered by the sampler's unit tests)."""
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.7, top_p=0.9, presence_penalty=0.5,
        frequency_penalty=0.5, seed=1,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 4,
                    "stop_token_ids": [2], "ignore_eos": False})
    assert r.usage.completion_tokens == 4
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith(PROMPT)
