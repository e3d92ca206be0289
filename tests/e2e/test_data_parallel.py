"""`splitserve serve --data-parallel-size 2` on the default model, on the CPU: two engine cores behind
one front. Greedy outputs equal one engine's; distinct prefixes spread evenly; requests sharing a
system prompt stay on one replica and hit its prefix cache as often as on one engine; a replica
killed mid-storm fails only its own requests and comes back."""
from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import httpx
import pytest

from conftest import DEFAULT_ARGS, ServerProcess, metric_value
from reliability_support import CALL_TIMEOUT_S, gather_bounded, stream_completion

pytestmark = pytest.mark.slow

# Prompts of 16-token blocks (the default block size): system prompts a few blocks long.
SYSTEM_PROMPTS = [[random.Random(100 + k).randrange(1000, 40000) for _ in range(3 * 16 + 5)] for k in range(8)]


def user_turn(k: int, j: int) -> list[int]:
    return SYSTEM_PROMPTS[k] + [random.Random(1000 * k + j).randrange(1000, 40000) for _ in range(6)]


@pytest.fixture(scope="module")
def dp_server():
    srv = ServerProcess(DEFAULT_ARGS + ["--data-parallel-size", "2"])
    try:
        srv.wait_healthy()
        yield srv
    finally:
        pids = [r["pid"] for r in health(srv)["replicas"]] if srv.proc.poll() is None else []
        srv.stop()
        deadline = time.monotonic() + 15
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if alive(p)]
            time.sleep(0.2)
        for p in pids:  # the test must leave nothing behind, whatever the server did
            os.kill(p, signal.SIGKILL)
        assert not pids, f"engine core processes {pids} outlived the server"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too
        return f.read().split()[2] != "Z"


def health(srv) -> dict:
    return httpx.get(srv.url + "/health", timeout=10).json()


def routed(srv) -> list[int]:
    return [r["requests_routed"] for r in health(srv)["replicas"]]


def complete_all(url: str, prompts: list, max_tokens: int, limit: int = 16) -> list[str]:
    async def run():
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=limit + 4)) as c:
            async def one(p):
                r = await c.post(url + "/v1/completions", json={"prompt": p, "max_tokens": max_tokens,
                                                              "temperature": 0, "ignore_eos": True},
                                 timeout=CALL_TIMEOUT_S)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]
            return await gather_bounded([one(p) for p in prompts], limit)
    return asyncio.run(run())


def test_greedy_outputs_equal_one_engines(dp_server):
    from splitserve import LLM, SamplingParams
    prompts = [[random.Random(i).randrange(1000, 40000) for _ in range(3 + i % 40)] for i in range(64)]
    before = routed(dp_server)
    got = complete_all(dp_server.url, prompts, 6)
    after = routed(dp_server)
    llm = LLM(max_model_len=2048, enable_prefix_caching=False)
    ref = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0,
                                                                           ignore_eos=True), use_tqdm=False)]
    del llm
    assert got == ref
    assert all(a - b > 0 for a, b in zip(after, before))  # both replicas served


def test_distinct_prefixes_spread_evenly(dp_server):
    prompts = [[random.Random(5000 + i).randrange(1000, 40000) for _ in range(20)] for i in range(200)]
    before = routed(dp_server)
    complete_all(dp_server.url, prompts, 1)
    share = [a - b for a, b in zip(routed(dp_server), before)]
    assert sum(share) == 200
    assert all(0.4 <= s / 200 <= 0.6 for s in share), share


def prefix_counters(url: str, labels: dict) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return (metric_value(text, "splitserve:prefix_cache_hits_total", labels),
            metric_value(text, "splitserve:prefix_cache_queries_total", labels))


def test_system_prompts_stick_to_one_replica_and_hit_as_often_as_one_engine(dp_server, server):
    turns = 20
    prompts = [user_turn(k, j) for j in range(turns) for k in range(8)]  # the prompts interleaved
    where: dict[int, list[int]] = {k: [] for k in range(8)}
    h0, q0 = prefix_counters(dp_server.url, {"engine": "all"})
    for j in range(0, turns, 2):  # two requests of one prompt at a time, to see which replica took them
        before = routed(dp_server)
        for k in range(8):
            complete_all(dp_server.url, [user_turn(k, j), user_turn(k, j + 1)], 1)
            after = routed(dp_server)
            where[k] += [i for i in range(2) for _ in range(after[i] - before[i])]
            before = after
    h1, q1 = prefix_counters(dp_server.url, {"engine": "all"})
    for k, replicas in where.items():
        assert len(replicas) == turns
        assert max(replicas.count(0), replicas.count(1)) >= 0.9 * turns, (k, replicas)
    # the same workload on one engine (the shared DP=1 server of the e2e suite)
    s0, t0 = prefix_counters(server.url, {})
    complete_all(server.url, prompts, 1)
    s1, t1 = prefix_counters(server.url, {})
    dp_rate, one_rate = (h1 - h0) / (q1 - q0), (s1 - s0) / (t1 - t0)
    assert one_rate > 0.5 and dp_rate >= 0.9 * one_rate, (dp_rate, one_rate)


def test_a_killed_replica_fails_only_its_requests_and_comes_back(dp_server):
    prompts = [[random.Random(9000 + i).randrange(1000, 40000) for _ in range(8)] for i in range(24)]
    body = {"max_tokens": 48, "temperature": 0, "ignore_eos": True}
    victim = health(dp_server)["replicas"][1]

    async def storm():
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=40)) as c:
            tasks = [asyncio.create_task(stream_completion(c, dp_server.url, {**body, "prompt": p})) for p in prompts]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # kill once the victim is busy with its share
                await asyncio.sleep(0.2)
                if (await c.get(dp_server.url + "/health")).json()["replicas"][1]["running"] > 0:
                    break
            os.kill(victim["pid"], signal.SIGKILL)
            return await asyncio.gather(*tasks)

    results = asyncio.run(storm())
    failed = [r for r in results if r.error is not None]
    ok = [r for r in results if r.error is None]
    assert failed and ok
    for r in failed:  # an error event naming the replica, then [DONE]: never a hang or a cut
        assert r.status == 200 and r.done and "engine replica 1" in r.error["message"], r.error
    for r in ok:
        assert r.status == 200 and r.done and r.finish_reason == "length"
    # the other replica keeps serving meanwhile, and the victim is back within 30 s, serving
    assert complete_all(dp_server.url, prompts[:4], 2)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        rep = health(dp_server)["replicas"][1]
        if rep["status"] == "ok" and rep["restarts"] == 1:
            break
        time.sleep(0.5)
    assert rep["status"] == "ok" and rep["restarts"] == 1 and rep["pid"] != victim["pid"], rep
    assert not alive(victim["pid"])
    before = routed(dp_server)[1]
    complete_all(dp_server.url, [[random.Random(77 + i).randrange(1000, 40000) for _ in range(5)] for i in range(8)], 2)
    assert routed(dp_server)[1] > before


def test_offline_llm_with_two_replicas_equals_one_engine(tiny_model_dir):
    from splitserve import LLM, SamplingParams
    prompts = [[random.Random(300 + i).randrange(3, 1000) for _ in range(2 + i % 20)] for i in range(24)]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm = LLM(tiny_model_dir, data_parallel_size=2, max_model_len=512)
    try:
        got = llm.generate(prompts, sp, use_tqdm=False)
        replicas = llm.engine.engine.replica_health()
        pids = [r["pid"] for r in replicas]
    finally:
        llm.engine.shutdown()
    assert all(r["requests_routed"] > 0 for r in replicas)
    ref = LLM(tiny_model_dir, max_model_len=512).generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in ref]
    assert not any(alive(p) for p in pids)
