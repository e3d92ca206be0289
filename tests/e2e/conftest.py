"""A real `splitserve serve` process per test module, on a free port of 127.0.0.1.

A module chooses the server's flags with a module-level `SERVER_ARGS` list. Loading the engine takes
tens of seconds on a CPU, so each module starts one server and shares it between its tests.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

STARTUP_TIMEOUT_S = 240
DEFAULT_ARGS = ["--max-model-len", "2048", "--max-num-seqs", "8", "--disable-access-log"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="splitserve-server-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "splitserve", "serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **env} if env else None)

    def log_tail(self, n: int = 40) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return "".join(f.readlines()[-n:])

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not healthy after {timeout}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if os.environ.get("SPLITSERVE_KEEP_SERVER_LOG"):
            print(f"server log kept at {self.log.name}")
        else:
            os.unlink(self.log.name)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random Llama with the default model's tokenizer and chat template: a real server on it
    starts in seconds and runs hundreds of requests fast (the reliability tests)."""
    from splitserve.loading.resolve import load_tokenizer
    from tests.hf_reference import make_tiny_llama_dir
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny-server-model"), load_tokenizer(None),
                               num_kv_heads=2, tie=True, seed=11)


@pytest.fixture(scope="session")
def _servers():
    """Servers by their flags, so modules that ask for the same flags share one process."""
    pool: dict[tuple, ServerProcess] = {}
    yield pool
    for srv in pool.values():
        srv.stop()


@pytest.fixture(scope="module")
def server(request, _servers):
    """The server for this module's SERVER_ARGS (shared with other modules asking the same)."""
    args = tuple(DEFAULT_ARGS + list(getattr(request.module, "SERVER_ARGS", [])))
    srv = _servers.get(args)
    if srv is None or srv.proc.poll() is not None:
        srv = _servers[args] = ServerProcess(list(args))
        srv.wait_healthy()
    return srv


@pytest.fixture(scope="module")
def own_server(request):
    """A server for this module alone, for tests that stop it (SIGTERM)."""
    srv = ServerProcess(DEFAULT_ARGS + list(getattr(request.module, "SERVER_ARGS", [])))
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def metric_value(text: str, name: str, labels: dict | None = None) -> float | None:
    """The value of one sample in Prometheus text output (labels must match those given)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        series, _, label_text = head.partition("{")
        if series != name:
            continue
        if labels and any(f'{k}="{v}"' not in label_text for k, v in labels.items()):
            continue
        return float(value)
    return None


@pytest.fixture
def metric(server):
    """metric(name, **labels): the current value of a sample on the server's /metrics."""
    def read(name: str, **labels) -> float | None:
        return metric_value(httpx.get(server.url + "/metrics", timeout=10).text, name, labels)
    return read
