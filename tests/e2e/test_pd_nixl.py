"""Prefill/decode disaggregation over the NixlConnector (NIXL in host memory on CPU; skipped where NIXL
is not installed), driven as vLLM's toy proxy drives two instances (test_pd_disaggregation.py says
how): greedy text equal to the prefill server answering alone, the decode instance computes one prompt
token per request and READs the rest, the producer's held blocks go back on the reader's notification,
and a killed prefill instance means recompute, not a hang."""
from __future__ import annotations

import json
import os
import signal

import pytest

from conftest import DEFAULT_ARGS, ServerProcess, free_port
from test_pd_disaggregation import MODEL, PROMPTS, _complete, _eventually, _metric, _prefill, _text

try:
    from splitserve.kv_transfer.nixl_transport import import_nixl
    import_nixl()
except ImportError:
    pytest.skip("NIXL is not installed (pip install 'splitserve[nixl]')", allow_module_level=True)


def _nixl(role: str, **extra) -> list[str]:
    return ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": role, **extra})]


@pytest.fixture(scope="module")
def servers():
    procs = {}
    try:
        procs["prefill"] = ServerProcess(DEFAULT_ARGS + _nixl("kv_producer", kv_port=free_port()))
        procs["decode"] = ServerProcess(DEFAULT_ARGS + _nixl("kv_consumer",
                                                             kv_connector_extra_config={"kv_load_timeout": 3}))
        for p in procs.values():
            p.wait_healthy()
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def test_nixl_greedy_text_equals_colocated_and_decode_computes_one_prompt_token(servers):
    prefill, decode = servers["prefill"], servers["decode"]
    bodies = [{"model": MODEL, "prompt": p, "max_tokens": 16, "temperature": 0} for p in PROMPTS[:3]]
    reference = [_text(_complete(prefill, b)) for b in bodies]  # the prefill server alone, no connector use
    computed0 = _metric(decode, "splitserve:prompt_tokens_computed_total")
    prompt_tokens = 0
    for body, ref in zip(bodies, reference):
        params = _prefill(prefill, body)["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["remote_block_ids"]
        out = _complete(decode, dict(body, kv_transfer_params=params))
        assert _text(out) == ref
        prompt_tokens += out["usage"]["prompt_tokens"]
    assert _metric(decode, "splitserve:prompt_tokens_computed_total") - computed0 == len(bodies)
    assert _metric(decode, "splitserve:kv_transfer_received_tokens_total") == prompt_tokens
    assert _metric(decode, "splitserve:kv_transfer_failed_total") == 0
    # The READs' notifications freed the held blocks (the lease is 30 s).
    assert _eventually(lambda: _metric(prefill, "splitserve:kv_transfer_held_requests") == 0, timeout=10)
    assert _metric(prefill, "splitserve:kv_transfer_sent_tokens_total") >= prompt_tokens


def test_nixl_prefill_killed_decode_recomputes(servers):
    """Runs last in the module: it kills the prefill instance."""
    prefill, decode = servers["prefill"], servers["decode"]
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 16, "temperature": 0}
    reference = _text(_complete(prefill, body))
    params = _prefill(prefill, body)["kv_transfer_params"]
    os.kill(prefill.proc.pid, signal.SIGKILL)
    prefill.proc.wait(timeout=30)
    failed0 = _metric(decode, "splitserve:kv_transfer_failed_total")
    out = _complete(decode, dict(body, kv_transfer_params=params))
    assert _text(out) == reference  # prefilled on the decode side instead
    assert _metric(decode, "splitserve:kv_transfer_failed_total") == failed0 + 1
    assert _eventually(lambda: _metric(decode, "splitserve:num_requests_running") == 0
                       and _metric(decode, "splitserve:kv_cache_usage_perc") == 0)
