"""Start-up mistakes end in one line and exit 2, before any model is loaded: a port in use, and
`--device cuda` on a machine without a GPU. (A free port is bound before the model loads too:
test_vllm_compat.py checks the order of those log lines.)"""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch

# Lines that only a start-up which went on to load the model would log.
LOADING_LINES = ("loading the model", "model built", "engine core", "KV cache:")


def run_serve(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "splitserve", "serve", *args], capture_output=True, text=True,
                          timeout=300)


def test_a_port_in_use_is_reported_before_the_model_loads(tiny_model_dir):
    with socket.socket() as other:  # another server holds the port
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        r = run_serve([tiny_model_dir, "--host", "127.0.0.1", "--port", str(port)])
    assert r.returncode == 2, r.stderr
    assert f"error: cannot listen on 127.0.0.1:{port}: the port is in use" in r.stderr
    output = r.stdout + r.stderr
    assert not any(line in output for line in LOADING_LINES), output
    assert "Traceback" not in output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_device_cuda_without_a_gpu_is_one_line(tiny_model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = run_serve([tiny_model_dir, "--port", str(port), "--device", "cuda"])
    assert r.returncode == 2
    errors = [line for line in r.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("error: --device cuda: no CUDA GPU is visible"), r.stderr
    assert "Traceback" not in r.stderr and "model built" not in r.stderr
