"""Prefill/decode disaggregation over the TcpConnector, driven the way vLLM's toy proxy drives two
instances (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py in vLLM): the prompt goes to the
prefill instance with max_tokens=1, stream off and kv_transfer_params {"do_remote_decode": true, ...
None}; the kv_transfer_params of its response go with the original request to the decode instance.

Servers (one module, started together): a producer (a 10 s lease, so that blocks nobody reads come
back within a test), two consumers (load-failure policies recompute and fail), and a server with a
tiny pool and --kv-offload-gb; `splitserve router --pd` in front of the producer and the first
consumer when vllm-router is installed. The colocated reference is a plain request to a server
(no kv_transfer_params: the connector is not involved): the fail-policy consumer for the router's
64 requests (a process of its own), the producer itself for the toy-proxy tests."""
from __future__ import annotations

import os
import signal
import time

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import DEFAULT_ARGS, ServerProcess, free_port, metric_value
from tests.router.conftest import NEEDS_ROUTER, RouterProcess

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
    "Write a short poem about the sea:",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Q: What is 12 times 12?\nA:" + " Let me think step by step." * 6,
]


def _tcp(role: str, **extra) -> list[str]:
    import json
    cfg = {"kv_connector": "TcpConnector", "kv_role": role, **extra}
    return ["--kv-transfer-config", json.dumps(cfg)]


@pytest.fixture(scope="module")
def servers():
    kv_port = free_port()
    wide = ["--max-num-seqs", "64"]  # the router's 64 concurrent requests run as one batch (no queueing)
    specs = {
        "prefill": wide + _tcp("kv_producer", kv_port=kv_port, kv_connector_extra_config={"kv_lease_duration": 10}),
        "decode": wide + _tcp("kv_consumer", kv_connector_extra_config={"kv_load_timeout": 3}),
        "decode_fail": wide + _tcp("kv_consumer", kv_load_failure_policy="fail",
                                   kv_connector_extra_config={"kv_load_timeout": 3}),
        # 48 blocks of 16 tokens: a 20-turn conversation (up to ~550 tokens) and a ~600-token filler
        # evict each other; host memory keeps both.
        "offload": ["--kv-offload-gb", "0.2", "--num-blocks", "48", "--max-model-len", "768"],
    }
    procs = {}
    try:
        for name, args in specs.items():
            # One torch thread each: four servers share the machine's cores, and threads that wait
            # on each other's time slices make every step a multiple slower.
            procs[name] = ServerProcess(DEFAULT_ARGS + args, env={"OMP_NUM_THREADS": "1"})
        for p in procs.values():
            p.wait_healthy()
        yield procs
    finally:
        for p in procs.values():
            p.stop()


@pytest.fixture(scope="module")
def router(servers):
    """`splitserve router --pd` in front of the producer and the recompute consumer (the toy-proxy
    tests talk to the servers themselves)."""
    # (a health check the busy servers answer late must not take them out of the rotation)
    r = RouterProcess(["--pd", "--prefill", servers["prefill"].url, "--decode", servers["decode"].url,
                       "--health-failure-threshold", "30"], expect_healthy=2)
    yield r
    r.stop()


def _metric(srv, name):
    return metric_value(httpx.get(srv.url + "/metrics", timeout=10).text, name, {"model_name": MODEL}) or 0.0


def _prefill(srv, body: dict, api: str = "/v1/completions") -> dict:
    """The toy proxy's first leg: the prefill instance's response (its kv_transfer_params)."""
    req = dict(body, stream=False, max_tokens=1,
               kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                   "remote_block_ids": None, "remote_host": None, "remote_port": None})
    r = httpx.post(srv.url + api, json=req, timeout=120)
    r.raise_for_status()
    return r.json()


def _eventually(check, timeout: float = 30.0) -> bool:
    """Whether check() turns true within the timeout (acknowledgements and frees are asynchronous)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)
    return True


def _text(resp: dict) -> str:
    c = resp["choices"][0]
    return c["text"] if "text" in c else c["message"]["content"]


def _complete(srv, body: dict, api: str = "/v1/completions") -> dict:
    r = httpx.post(srv.url + api, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_disaggregated_greedy_text_equals_colocated_and_decode_computes_one_prompt_token(servers):
    prefill, decode = servers["prefill"], servers["decode"]
    bodies = [{"model": MODEL, "prompt": p, "max_tokens": 16, "temperature": 0} for p in PROMPTS]
    bodies.append({"model": MODEL, "messages": [{"role": "user", "content": "Name three colours."}],
                   "max_tokens": 16, "temperature": 0})
    apis = ["/v1/completions"] * len(PROMPTS) + ["/v1/chat/completions"]
    reference = [_text(_complete(prefill, b, api)) for b, api in zip(bodies, apis)]  # before any PD request
    computed0 = _metric(decode, "splitserve:prompt_tokens_computed_total")
    received0 = _metric(decode, "splitserve:kv_transfer_received_tokens_total")
    prompt_tokens = 0
    for body, api, ref in zip(bodies, apis, reference):
        first = _prefill(prefill, body, api)
        params = first["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["remote_block_ids"]
        assert {"remote_engine_id", "remote_host", "remote_port", "remote_request_id"} <= params.keys()
        out = _complete(decode, dict(body, kv_transfer_params=params), api)
        assert _text(out) == ref
        prompt_tokens += out["usage"]["prompt_tokens"]
    n = len(bodies)
    assert _metric(decode, "splitserve:prompt_tokens_computed_total") - computed0 == n  # one per request
    assert _metric(decode, "splitserve:kv_transfer_received_tokens_total") - received0 == prompt_tokens
    assert _metric(decode, "splitserve:kv_transfer_time_seconds_count") >= n
    assert _metric(decode, "splitserve:kv_transfer_failed_total") == 0
    # Every held block was read and acknowledged: nothing stays held on the producer (the lease is 30 s).
    assert _eventually(lambda: _metric(prefill, "splitserve:kv_transfer_held_requests") == 0, timeout=10)
    assert _metric(prefill, "splitserve:kv_transfer_sent_tokens_total") >= prompt_tokens


def test_unread_prefill_blocks_are_released_when_the_client_leaves_the_decode_side(servers):
    """A decode request aborted by its client frees its blocks there; the prefill side's held blocks
    go back when the (still running) read acknowledges, or at lease end."""
    prefill, decode = servers["prefill"], servers["decode"]
    body = {"model": MODEL, "prompt": PROMPTS[1] * 3, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    params = _prefill(prefill, body)["kv_transfer_params"]
    with httpx.stream("POST", decode.url + "/v1/completions", json=dict(body, kv_transfer_params=params),
                      timeout=120) as r:
        for _ in r.iter_lines():
            break  # the client leaves after the first event
    assert _eventually(lambda: _metric(decode, "splitserve:num_requests_running") == 0
                       and _metric(decode, "splitserve:kv_cache_usage_perc") == 0)
    assert _eventually(lambda: _metric(prefill, "splitserve:kv_transfer_held_requests") == 0, timeout=10)


SUBJECTS = ["the moon", "a red bicycle", "rain in April", "the number seven", "old libraries", "coffee",
            "a lighthouse", "winter birds"]


def _router_bodies(n: int) -> list[tuple[str, dict]]:
    """n short greedy requests (one to three KV blocks of prompt), every fourth a chat."""
    out = []
    for i in range(n):
        subject = SUBJECTS[i % len(SUBJECTS)]
        if i % 4 == 3:
            out.append(("/v1/chat/completions", {"model": MODEL, "max_tokens": 6, "temperature": 0,
                                                 "messages": [{"role": "user", "content": f"Say one thing about {subject}."}]}))
        else:
            prompt = f"Note {i}. " + "Here is a short story about " * (1 + i % 3) + f"{subject}:"
            out.append(("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0}))
    return out


def _gauges(srv) -> dict:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    names = ["num_requests_running", "num_requests_waiting", "kv_transfer_receiving", "kv_transfer_held_requests",
             "kv_cache_usage_perc"]
    return {n: metric_value(text, "splitserve:" + n, {"model_name": MODEL}) for n in names}


def _idle_and_whole(srv) -> bool:
    """Nothing running, waiting, receiving or held, and every KV block back in the free pool."""
    return all(v == 0 for v in _gauges(srv).values())


@NEEDS_ROUTER
def test_router_64_concurrent_requests_equal_colocated_and_decode_computes_one_prompt_token_each(servers, router):
    prefill, decode, colocated = servers["prefill"], servers["decode"], servers["decode_fail"]
    bodies = _router_bodies(64)
    with ThreadPoolExecutor(64) as pool:
        reference = list(pool.map(lambda ab: _text(_complete(colocated, ab[1], ab[0])), bodies))
        computed0 = _metric(decode, "splitserve:prompt_tokens_computed_total")
        received0 = _metric(decode, "splitserve:kv_transfer_received_tokens_total")
        failed0 = _metric(decode, "splitserve:kv_transfer_failed_total")
        hits0 = _metric(decode, "splitserve:prefix_cache_hits_total")
        outs = list(pool.map(lambda ab: _complete(router, ab[1], ab[0]), bodies))
    assert [_text(o) for o in outs] == reference
    prompt_tokens = sum(o["usage"]["prompt_tokens"] for o in outs)
    assert _metric(decode, "splitserve:prompt_tokens_computed_total") - computed0 == len(bodies)  # one each
    # Every other prompt token was received, or found in the decode side's own prefix cache (the
    # chat template's system prompt, say), which is not read again.
    received = _metric(decode, "splitserve:kv_transfer_received_tokens_total") - received0
    assert received + _metric(decode, "splitserve:prefix_cache_hits_total") - hits0 == prompt_tokens
    assert received > prompt_tokens / 2
    assert _metric(decode, "splitserve:kv_transfer_failed_total") == failed0
    assert _eventually(lambda: _idle_and_whole(prefill) and _idle_and_whole(decode), timeout=15)


@NEEDS_ROUTER
def test_router_150_streams_with_30_percent_client_disconnects_leave_both_pools_whole(servers, router):
    """45 of 150 streamed requests through the router are dropped by their clients: before any answer
    (while the prefill leg runs or the decode request waits), or after one or two events. The other
    105 finish; afterwards both engines are idle and every block is back in both pools (blocks a
    reader never came for go back at the producer's 10 s lease end)."""
    prefill, decode = servers["prefill"], servers["decode"]
    rng = random.Random(38)
    plan = [rng.choice(["early", 1, 2]) for _ in range(45)] + [None] * 105
    rng.shuffle(plan)
    bodies = _router_bodies(150)
    finished, errors = [], []

    def one(i: int) -> None:
        api, body = bodies[i]
        body = dict(body, stream=True, max_tokens=8)
        leave = plan[i]
        try:
            timeout = httpx.Timeout(300, read=rng.uniform(0.05, 0.5)) if leave == "early" else 300
            with httpx.stream("POST", router.url + api, json=body, timeout=timeout) as r:
                assert r.status_code == 200, r.read()
                events = 0
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events += 1
                        if leave is not None and events >= leave:
                            return  # the client goes away mid-stream
                        if line == "data: [DONE]":
                            finished.append(i)
        except httpx.ReadTimeout:
            if leave != "early":
                errors.append(f"{i}: read timeout")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(150)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors[:5]
    assert set(finished) >= {i for i, leave in enumerate(plan) if leave is None}
    assert _eventually(lambda: _idle_and_whole(prefill) and _idle_and_whole(decode), timeout=40), \
        {"prefill": _gauges(prefill), "decode": _gauges(decode)}


def test_prefill_killed_recompute_completes_and_fail_errors_clearly(servers):
    """Runs last in the module: it kills the prefill instance."""
    prefill, decode, decode_fail = servers["prefill"], servers["decode"], servers["decode_fail"]
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 16, "temperature": 0}
    reference = _text(_complete(prefill, body))
    params = [_prefill(prefill, body)["kv_transfer_params"] for _ in range(2)]
    os.kill(prefill.proc.pid, signal.SIGKILL)
    prefill.proc.wait(timeout=30)
    failed0 = _metric(decode, "splitserve:kv_transfer_failed_total")
    out = _complete(decode, dict(body, kv_transfer_params=params[0]))
    assert _text(out) == reference                                # prefilled on the decode side instead
    assert _metric(decode, "splitserve:kv_transfer_failed_total") == failed0 + 1
    r = httpx.post(decode_fail.url + "/v1/completions", json=dict(body, kv_transfer_params=params[1]), timeout=60)
    assert r.status_code == 500, r.text
    msg = r.json()["error"]["message"]
    assert "did not answer" in msg and "kv_load_timeout" in msg, msg
    # Both consumers are idle and whole afterwards.
    for srv in (decode, decode_fail):
        assert _eventually(lambda: _metric(srv, "splitserve:num_requests_running") == 0
                           and _metric(srv, "splitserve:kv_cache_usage_perc") == 0)


def test_offloading_multi_turn_chat_hits_host_memory_with_the_same_text(servers):
    """A 20-turn conversation whose prefix a filler request evicts from a 48-block pool after every
    turn: the offload server finds it in host memory each time, and answers as a server with a large
    pool and no offload does."""
    small, big = servers["offload"], servers["decode"]

    def filler(i: int) -> dict:  # ~600 tokens, a new first block each time (so no prefix hits of its own)
        return {"model": MODEL, "prompt": f"Story {i}. " + "Tell me about the history of the printing press. " * 55,
                "max_tokens": 1, "temperature": 0}

    def converse(srv, evict: bool) -> list[str]:
        messages = [{"role": "system", "content": "You are a concise assistant. " * 8}]
        replies = []
        for i in range(20):
            messages.append({"role": "user", "content": f"Name a number larger than {7 * i + 3}."})
            out = _complete(srv, {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0},
                            "/v1/chat/completions")
            replies.append(out["choices"][0]["message"]["content"])
            messages.append({"role": "assistant", "content": replies[-1]})
            if evict:
                _complete(srv, filler(i))
        return replies

    hits0 = _metric(small, "splitserve:kv_transfer_offload_hit_tokens_total")
    assert converse(small, evict=True) == converse(big, evict=False)
    assert _metric(small, "splitserve:kv_transfer_offload_saved_blocks_total") > 0
    # Every turn after the first finds the conversation so far in host memory: at least the system
    # prompt's and the first turns' blocks, 19 times.
    assert _metric(small, "splitserve:kv_transfer_offload_hit_tokens_total") - hits0 >= 19 * 3 * 16
    assert _eventually(lambda: _metric(small, "splitserve:kv_cache_usage_perc") == 0)


def test_tensor_parallel_prefill_to_one_rank_decode(tiny_model_dir):
    """Prefill on two ranks (gloo), decode on one, the tiny model (2 KV heads: one per prefill rank):
    the decode instance reads each rank's heads and answers as it does alone."""
    from reliability_support import TINY_ARGS
    kv_port = free_port()
    prefill = ServerProcess([tiny_model_dir, *TINY_ARGS, "-tp", "2", "--cpu-kv-cache-gib", "0.05",
                             *_tcp("kv_producer", kv_port=kv_port)])
    decode = ServerProcess([tiny_model_dir, *TINY_ARGS, "--cpu-kv-cache-gib", "0.05", *_tcp("kv_consumer")])
    try:
        prefill.wait_healthy(timeout=600)
        decode.wait_healthy()
        for prompt in ("Once upon a time", "The quick brown fox jumps over the lazy dog. " * 3):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            reference = _text(_complete(decode, body))                 # colocated, one rank
            params = _prefill(prefill, body)["kv_transfer_params"]
            assert params["tp_size"] == 2
            assert _text(_complete(decode, dict(body, kv_transfer_params=params))) == reference
        tiny = {"model_name": "tiny"}
        text = httpx.get(decode.url + "/metrics", timeout=10).text
        assert metric_value(text, "splitserve:kv_transfer_failed_total", tiny) == 0
        assert metric_value(text, "splitserve:kv_transfer_received_tokens_total", tiny) > 0
        assert _eventually(lambda: metric_value(httpx.get(prefill.url + "/metrics", timeout=10).text,
                                                "splitserve:kv_transfer_held_requests", tiny) == 0, timeout=10)
    finally:
        prefill.stop()
        decode.stop()
