"""Engine faults injected into the model step (SPLITSERVE_INJECT_STEP_FAULTS, test-only).

A transient fault (every 23rd step) fails the requests of that step with an error response — a 500
in the OpenAI error shape, or an in-band error event then [DONE] for a stream — and nothing else:
the other requests get exactly their fault-free outputs, the server stays healthy, every KV block
comes back. A permanent fault (every step from the first) makes the engine give up after a few
failed steps: /health turns 503 and new requests get 503 with Retry-After.
"""
from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from reliability_support import CALL_TIMEOUT_S, gather_bounded, metric, running_server, stream_completion, wait_idle

ENV = "SPLITSERVE_INJECT_STEP_FAULTS"
NUM_REQUESTS = 80
NEW_TOKENS = 10
PROMPTS = [[random.Random(i).randrange(3, 40000) for _ in range(2 + i % 30)] for i in range(NUM_REQUESTS)]


def body(prompt) -> dict:
    return {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


def injected_faults(srv) -> int:
    return srv.log_tail(100000).count("injected fault in model step")


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[str]:
    from splitserve import LLM, SamplingParams
    llm = LLM(tiny_model_dir, num_blocks=1024, enable_prefix_caching=False, max_model_len=512)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


async def plain_completion(c: httpx.AsyncClient, url: str, b: dict) -> httpx.Response:
    return await c.post(url + "/v1/completions", json=b, timeout=CALL_TIMEOUT_S)


def test_transient_step_faults_fail_only_their_requests(tiny_model_dir, reference):
    with running_server(tiny_model_dir, ["--max-num-seqs", "8"], env={ENV: "every=23"}) as srv:
        async def run():
            async with httpx.AsyncClient(limits=httpx.Limits(max_connections=NUM_REQUESTS + 5)) as c:
                calls = [stream_completion(c, srv.url, body(p)) if i % 2 else plain_completion(c, srv.url, body(p))
                         for i, p in enumerate(PROMPTS)]
                return await gather_bounded(calls, NUM_REQUESTS)

        results = asyncio.run(run())
        failed = succeeded = 0
        for i, res in enumerate(results):
            assert not isinstance(res, BaseException), (i, repr(res))
            if isinstance(res, httpx.Response):        # a plain response
                if res.status_code == 200:
                    assert res.json()["choices"][0]["text"] == reference[i], i
                    succeeded += 1
                else:
                    assert res.status_code == 500, (i, res.status_code, res.text)
                    err = res.json()["error"]
                    assert set(err) == {"message", "type", "param", "code"} and "engine failed" in err["message"]
                    failed += 1
            else:                                       # a stream: headers are out, so the error is in-band
                assert res.status == 200 and res.done, (i, res.status, res.body)
                if res.error is None:
                    assert res.finish_reason == "length" and res.text == reference[i], i
                    succeeded += 1
                else:
                    assert res.finish_reason is None and "engine failed" in res.error["message"], res.error
                    failed += 1
        faults = injected_faults(srv)
        print(f"{NUM_REQUESTS} requests, {faults} step faults injected: {failed} failed, {succeeded} succeeded")
        assert faults >= 3 and failed >= faults and succeeded >= NUM_REQUESTS // 4
        assert metric(srv.url, "splitserve:request_success_total", finished_reason="error") == failed
        wait_idle(srv.url)
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        r = httpx.post(srv.url + "/v1/completions", json=body(PROMPTS[0]), timeout=CALL_TIMEOUT_S)
        assert r.status_code in (200, 500)  # the next step may be a 23rd again; the server keeps answering


def test_a_dead_engine_reports_503(tiny_model_dir):
    with running_server(tiny_model_dir, [], env={ENV: "from=1"}) as srv:
        statuses = []
        for _ in range(6):
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4},
                           timeout=CALL_TIMEOUT_S)
            statuses.append(r.status_code)
            assert "error" in r.json()
            if r.status_code == 503:
                break
        # each failed step fails its request (500) until three in a row make the engine give up
        assert statuses[:2] == [500, 500] and statuses[-1] == 503, statuses
        h = httpx.get(srv.url + "/health", timeout=10)
        assert h.status_code == 503 and "engine has stopped" in h.json()["error"]["message"]
        for path, b in (("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stream": True})):
            r = httpx.post(srv.url + path, json=b, timeout=CALL_TIMEOUT_S)
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
        assert srv.proc.poll() is None  # still up to answer probes; the orchestrator restarts it
