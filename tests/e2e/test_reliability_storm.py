"""KV exhaustion and an abort storm through real HTTP streams, on a server with a tiny KV pool.

The pool holds 48 blocks of 8 tokens (384 tokens) and runs up to 32 sequences: hundreds of
concurrent requests far exceed it, so the scheduler preempts and recomputes all the time. Greedy
outputs must equal an unconstrained offline run token for token (compared as text), no request may
be lost or answered twice, preemptions must show in /metrics, and every KV block must come back.
Then a random subset of clients walks away at random moments — before the first byte, mid-stream,
while waiting for a plain response — and the survivors must still get exactly their tokens.
"""
from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from reliability_support import CALL_TIMEOUT_S, gather_bounded, metric, running_server, stream_completion, wait_idle

NUM_BLOCKS, BLOCK_SIZE = 48, 8
SERVER_FLAGS = ["--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE), "--max-num-batched-tokens", "64",
                "--max-num-seqs", "32"]
NEW_TOKENS = 12
NUM_REQUESTS = 300


def make_prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    # up to 120 tokens: longer prompts than the 64-token step budget are prefilled in chunks
    return [[rng.randrange(3, 40000) for _ in range(rng.randrange(2, 120))] for _ in range(count)]


PROMPTS = make_prompts(7, NUM_REQUESTS)


def body(prompt) -> dict:
    return {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[str]:
    """The texts of an offline run with room for everything (no preemption, no prefix cache)."""
    from splitserve import LLM, SamplingParams
    llm = LLM(tiny_model_dir, num_blocks=1024, enable_prefix_caching=False, max_model_len=512)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def srv(tiny_model_dir):
    with running_server(tiny_model_dir, SERVER_FLAGS) as s:
        yield s


def finished_count(url: str) -> dict[str, float]:
    """Requests finished, by reason, and requests the engine took in ("added")."""
    counts = {r: metric(url, "splitserve:request_success_total", finished_reason=r)
              for r in ("length", "stop", "abort", "error")}
    counts["added"] = metric(url, "splitserve:num_requests_added_total")
    return counts


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=NUM_REQUESTS + 10, max_keepalive_connections=0))


def test_kv_exhaustion_preempts_and_recomputes_exactly(srv, reference):
    preempted_before = metric(srv.url, "splitserve:num_preemptions_total")
    before = finished_count(srv.url)

    async def run():
        async with client() as c:
            return await gather_bounded([stream_completion(c, srv.url, body(p)) for p in PROMPTS], NUM_REQUESTS)

    results = asyncio.run(run())
    for i, res in enumerate(results):
        assert not isinstance(res, BaseException), (i, repr(res))
        assert res.status == 200 and res.done and res.error is None, (i, res.status, res.body, res.error)
        assert res.finish_reason == "length" and res.text == reference[i], (i, res.text, reference[i])
    after = finished_count(srv.url)
    # each request finished exactly once on the server: none lost, none duplicated
    assert after["length"] - before["length"] == NUM_REQUESTS == after["added"] - before["added"]
    assert all(after[r] == before[r] for r in ("stop", "abort", "error"))
    preemptions = metric(srv.url, "splitserve:num_preemptions_total") - preempted_before
    print(f"{NUM_REQUESTS} concurrent requests on {NUM_BLOCKS} KV blocks: {preemptions:.0f} preemptions")
    assert preemptions > 0
    wait_idle(srv.url)


async def doomed_call(c: httpx.AsyncClient, url: str, prompt, rng: random.Random) -> str:
    """One request whose client gives up at a random moment; returns how it left."""
    how = rng.choice(["before_stream", "mid_stream", "plain_timeout", "stream_timeout"])
    if how == "before_stream":      # closes right after the response headers: usually still waiting
        await stream_completion(c, url, body(prompt), leave_after_chunks=0)
    elif how == "mid_stream":       # closes after a few tokens: mid-decode
        await stream_completion(c, url, body(prompt), leave_after_chunks=rng.randrange(1, NEW_TOKENS))
    else:                           # cancelled at a random time: waiting, prefilling or decoding
        call = (c.post(url + "/v1/completions", json=body(prompt), timeout=CALL_TIMEOUT_S) if how == "plain_timeout"
                else stream_completion(c, url, body(prompt)))
        try:
            await asyncio.wait_for(call, timeout=rng.uniform(0.0, 1.5))
        except asyncio.TimeoutError:
            pass
    return how


def test_abort_storm_over_http(srv, reference):
    rng = random.Random(1234)
    doomed = set(rng.sample(range(NUM_REQUESTS), NUM_REQUESTS * 2 // 5))
    before = finished_count(srv.url)

    async def run():
        async with client() as c:
            calls = [doomed_call(c, srv.url, p, random.Random(i)) if i in doomed else stream_completion(c, srv.url, body(p))
                     for i, p in enumerate(PROMPTS)]
            return await gather_bounded(calls, NUM_REQUESTS)

    results = asyncio.run(run())
    ways = {}
    for i, res in enumerate(results):
        assert not isinstance(res, BaseException), (i, repr(res))
        if i in doomed:
            ways[res] = ways.get(res, 0) + 1
            continue
        assert res.status == 200 and res.done and res.error is None, (i, res.status, res.body, res.error)
        assert res.text == reference[i] and res.finish_reason == "length", (i, res.text, reference[i])
    print(f"cancelled {len(doomed)} of {NUM_REQUESTS} requests: {ways}")
    assert len(ways) == 4
    wait_idle(srv.url)  # nothing left running or waiting, every KV block back in the pool
    after = finished_count(srv.url)
    aborted = after["abort"] - before["abort"]
    completed = after["length"] - before["length"]
    added = after["added"] - before["added"]
    # Every request the engine took in ended exactly once (a client that left before its request
    # reached the engine is never added); doomed ones that finished before their client left count
    # as length.
    assert aborted + completed == added and NUM_REQUESTS - len(doomed) <= completed and added <= NUM_REQUESTS
    assert aborted >= len(doomed) // 2, (aborted, len(doomed))
    assert after["error"] == before["error"]
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


def test_a_request_that_can_never_fit_is_refused_at_once(srv):
    capacity = NUM_BLOCKS * BLOCK_SIZE
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": [5] * (capacity - 4), "max_tokens": 8},
                   timeout=CALL_TIMEOUT_S)
    assert r.status_code == 400, r.text
    assert "KV cache" in r.json()["error"]["message"] and str(capacity) in r.json()["error"]["message"]
    # n sequences that each fit alone but not together: run one after another, preempting, no hang
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": [5] * 200, "max_tokens": 100, "n": 3,
                                                      "ignore_eos": True, "temperature": 0}, timeout=CALL_TIMEOUT_S)
    assert r.status_code == 200, r.text
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["length"] * 3
    # no max_tokens: the output is capped by what the cache can hold, and the request ends
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                           "ignore_eos": True}, timeout=CALL_TIMEOUT_S)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
    assert r.json()["usage"]["total_tokens"] <= capacity
    wait_idle(srv.url)
