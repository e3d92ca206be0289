"""`splitserve serve -tp N` on CPU (gloo): one worker process per rank under the engine core. The
official `openai` client is served by the default model on three ranks (the same greedy text as the
offline engine on one), SIGTERM leaves no process behind, and a rank killed mid-stream ends the
streams with an error, turns /health to 503 and takes every process down."""
from __future__ import annotations

import json
import re
import signal

import httpx
import openai
import psutil

from conftest import DEFAULT_ARGS, ServerProcess
from reliability_support import CALL_TIMEOUT_S, running_server

PROMPT = "The capital of France is"


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def rank_processes(server_pid: int) -> list[psutil.Process]:
    """The worker processes: children of the engine core (the server's spawned child), spawned too."""
    core = next(c for c in psutil.Process(server_pid).children() if "spawn_main" in " ".join(c.cmdline()))
    return [c for c in core.children() if "spawn_main" in " ".join(c.cmdline())]


def test_serve_tp3_default_model_openai_client_and_sigterm_leaves_nothing():
    from splitserve.engine.llm import LLM
    from splitserve.sampling_params import SamplingParams
    want = LLM(max_model_len=512, cpu_kv_cache_gib=0.1).generate([PROMPT], SamplingParams(max_tokens=8, temperature=0),
                                                                 use_tqdm=False)[0].outputs[0].text
    srv = ServerProcess(DEFAULT_ARGS + ["-tp", "3", "--cpu-kv-cache-gib", "0.1"])
    try:
        srv.wait_healthy(timeout=600)
        assert len(rank_processes(srv.proc.pid)) == 3
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=CALL_TIMEOUT_S)
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
        assert out.choices[0].text == want and out.usage.completion_tokens == 8
        tree = descendants(srv.proc.pid)
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=60) == 0
        gone, alive = psutil.wait_procs(tree, timeout=30)
        assert not alive, f"left behind: {[(p.pid, p.cmdline()) for p in alive]}"
    finally:
        srv.stop()


def test_a_rank_killed_mid_stream_fails_the_streams_and_every_process_exits(tiny_model_dir):
    with running_server(tiny_model_dir, ["-tp", "2", "--cpu-kv-cache-gib", "0.05"]) as srv:
        tree = descendants(srv.proc.pid)
        victim = rank_processes(srv.proc.pid)[1]
        body = {"prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}
        lines: list[str] = []
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=CALL_TIMEOUT_S) as r:
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 4:
                    victim.send_signal(signal.SIGKILL)
        errors = [json.loads(x[6:])["error"] for x in lines if x.startswith("data: {") and '"error"' in x]
        assert errors, lines[-3:]
        health = httpx.get(srv.url + "/health", timeout=10)
        assert health.status_code == 503 and re.search(r"rank \d was killed by SIGKILL", health.json()["error"]["message"])
        assert srv.proc.wait(timeout=30) != 0
        gone, alive = psutil.wait_procs(tree, timeout=30)
        assert not alive, f"left behind: {[(p.pid, p.cmdline()) for p in alive]}"
