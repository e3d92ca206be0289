"""`splitserve serve --quantization fp8`: the server says which quantization runs (start-up log and
/v1/models), serves completions, and refuses an unsupported quantization before starting."""
from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.e2e.conftest import ServerProcess

FP8 = "fp8: FP8 per-channel weights, dynamic per-token activations (quantized at load)"


@pytest.fixture(scope="module")
def fp8_server(tiny_model_dir):
    srv = ServerProcess([tiny_model_dir, "--quantization", "fp8", "--served-model-name", "tiny-fp8", "--max-num-seqs", "8"])
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def test_fp8_server_says_what_runs_and_serves(fp8_server):
    card = httpx.get(fp8_server.url + "/v1/models").json()["data"][0]
    assert card["id"] == "tiny-fp8" and card["quantization"] == FP8
    assert f"quantization {FP8}" in fp8_server.log_tail(200)
    r = httpx.post(fp8_server.url + "/v1/completions", timeout=120,
                   json={"model": "tiny-fp8", "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_unsupported_quantization_fails_before_serving(tiny_model_dir):
    out = subprocess.run([sys.executable, "-m", "splitserve", "serve", tiny_model_dir, "--quantization", "modelopt"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "quantization 'modelopt' needs a checkpoint quantized in that format" in out.stderr
