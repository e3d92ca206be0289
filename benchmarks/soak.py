"""Sustained-load soak: thousands of streaming requests on loopback, zero failures allowed, and the
server's memory must come back to its level before the load.

    python benchmarks/soak.py                                  # 2,000 streams at concurrency 64, default model
    python benchmarks/soak.py --requests 300 --concurrency 32 MODEL_DIR   # smaller, any model
    python benchmarks/soak.py --url http://127.0.0.1:8000 --pid PID       # an already running server

It starts `splitserve serve` itself unless --url is given. A warm-up (twice the concurrency) fills the
allocator pools and caches first; the memory baseline (the server's RSS) is read after it, when the
server is idle. Then the soak runs: streaming completions and chat completions, alternating, with
varied prompts and lengths. A request fails if it does not get HTTP 200, an error event, its
finish_reason, or `data: [DONE]`. After the soak, once the server is idle again, its RSS is read
again. Prints one JSON summary; exits 1 on any failure or when memory grew by more than the margin.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import psutil

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly brew strange potions "
         "under an old bridge near the river that flows into a distant sea").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, extra: list[str]) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="soak-server-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "splitserve", "serve", *([model] if model else []), "--host", "127.0.0.1",
           "--port", str(port), "--disable-access-log", *extra]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; log: {log.name}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log.name
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"server not healthy after 300 s; log: {log.name}")


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_idle(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (metric(url, "splitserve:num_requests_running") == 0 and metric(url, "splitserve:num_requests_waiting") == 0
                and metric(url, "splitserve:kv_cache_usage_perc") == 0):
            return
        time.sleep(0.1)
    raise RuntimeError(f"server not idle {timeout} s after the load")


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2 ** 20


async def one_request(c: httpx.AsyncClient, url: str, i: int, max_tokens: int) -> str | None:
    """Streams request i; returns None on success, else what went wrong."""
    rng = random.Random(i)
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 40)))
    tokens = rng.randrange(max(1, max_tokens // 2), max_tokens + 1)
    if i % 2:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}
    else:
        path, body = "/v1/completions", {"prompt": text}
    body.update(max_tokens=tokens, stream=True, temperature=0.7, seed=i, stream_options={"include_usage": True})
    finish, done = None, False
    try:
        async with c.stream("POST", url + path, json=body, timeout=300) as r:
            if r.status_code != 200:
                return f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    done = True
                    break
                event = json.loads(payload)
                if "error" in event:
                    return f"error event: {event['error']}"
                for choice in event["choices"]:
                    finish = choice.get("finish_reason") or finish
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return f"{type(e).__name__}: {e}"
    if not done or finish not in ("stop", "length"):
        return f"incomplete stream: done={done} finish_reason={finish}"
    return None


async def run_load(url: str, num: int, concurrency: int, max_tokens: int, first_id: int = 0) -> list[str]:
    """Runs `num` requests, at most `concurrency` at a time; returns the failures."""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    done = 0

    async with httpx.AsyncClient(limits=limits) as c:
        async def guarded(i):
            nonlocal done
            async with sem:
                result = await one_request(c, url, i, max_tokens)
            done += 1
            if done % max(1, num // 10) == 0:
                print(f"  {done}/{num} requests done", file=sys.stderr, flush=True)
            return result
        results = await asyncio.gather(*(guarded(first_id + i) for i in range(num)))
    return [r for r in results if r is not None]


def soak(url: str, pid: int, requests: int, concurrency: int, max_tokens: int, warmup: int | None = None) -> dict:
    warmup = 2 * concurrency if warmup is None else warmup
    warm_failures = asyncio.run(run_load(url, warmup, concurrency, max_tokens, first_id=10 ** 6))
    wait_idle(url)
    rss_before = rss_mib(pid)
    started = time.monotonic()
    failures = asyncio.run(run_load(url, requests, concurrency, max_tokens))
    elapsed = time.monotonic() - started
    wait_idle(url)
    time.sleep(1.0)  # let the last responses' buffers go
    rss_after = rss_mib(pid)
    return {"requests": requests, "concurrency": concurrency, "max_tokens": max_tokens, "warmup_requests": warmup,
            "failures": len(failures) + len(warm_failures), "failure_examples": (warm_failures + failures)[:5],
            "elapsed_s": round(elapsed, 1), "requests_per_s": round(requests / elapsed, 2),
            "rss_before_mib": round(rss_before, 1), "rss_after_mib": round(rss_after, 1),
            "rss_growth_mib": round(rss_after - rss_before, 1),
            "rss_growth_pct": round(100 * (rss_after - rss_before) / rss_before, 2),
            "health": httpx.get(url + "/health", timeout=10).status_code}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=None, help="model to serve (default: the default model)")
    p.add_argument("--url", default=None, help="use this running server instead of starting one (needs --pid)")
    p.add_argument("--pid", type=int, default=None, help="the running server's process id (for its memory)")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32, help="each request asks for 1/2..1 of this")
    p.add_argument("--mem-margin-pct", type=float, default=5.0, help="allowed RSS growth, percent (default 5)")
    p.add_argument("--server-arg", action="append", default=[], help="extra `splitserve serve` argument (repeatable)")
    args = p.parse_args(argv)
    proc = None
    if args.url:
        if args.pid is None:
            p.error("--url needs --pid")
        url, pid, log = args.url, args.pid, None
    else:
        proc, url, log = start_server(args.model, ["--max-num-seqs", str(args.concurrency), *args.server_arg])
        pid = proc.pid
    try:
        summary = soak(url, pid, args.requests, args.concurrency, args.max_tokens)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            summary_rc = proc.wait(timeout=60)
            os.unlink(log)
    if proc is not None:
        summary["server_exit_status"] = summary_rc
    print(json.dumps(summary, indent=2))
    ok = summary["failures"] == 0 and summary["rss_growth_pct"] <= args.mem_margin_pct and summary["health"] == 200
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
