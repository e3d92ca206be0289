"""`splitserve bench serve` against splitserve's own server, on the tiny random Llama with the default
model's tokenizer: what is checked (the client's counts, metrics and saved results) does not depend on
the model, and the default model's decode steps made this the slowest e2e test (~100 s of 6 x 8
tokens, twice, on two contended cores). The default model's serving is covered by test_server_openai."""
import json
import subprocess
import sys

import pytest

from reliability_support import running_server

METRICS = ("ttft", "tpot", "itl", "e2e")
STATS = ("mean", "median", "p90", "p99")


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with running_server(tiny_model_dir, ["--max-num-seqs", "8"]) as srv:
        yield srv


def test_short_run_has_no_failures_and_full_results(server, tiny_model_dir, tmp_path):
    result = tmp_path / "result.json"
    for endpoint in ("completions", "chat"):
        p = subprocess.run(
            [sys.executable, "-m", "splitserve", "bench", "serve", "--base-url", server.url, "--endpoint", endpoint,
             "--tokenizer", tiny_model_dir,
             "--dataset", "random", "--random-input-len", "32", "--random-output-len", "8", "--num-prompts", "6",
             "--ignore-eos", "--seed", "3", "--disable-tqdm", "--save-result", str(result)],
            capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        for label in ("Successful requests", "Failed requests", "Median TTFT", "P99 TPOT", "Mean ITL",
                      "Output token throughput"):
            assert label in p.stdout
        data = json.loads(result.read_text())
        m = data["metrics"]
        assert m["completed"] == 6 and m["failed"] == 0 and m["errors"] == {}
        assert m["total_output_tokens"] == 6 * 8  # ignore_eos: exactly the asked length
        for key in ("duration", "request_throughput", "output_throughput", "total_token_throughput"):
            assert m[key] > 0
        for metric in METRICS:
            assert all(m[metric][s] > 0 for s in STATS), (metric, m[metric])
        assert len(data["requests"]) == 6
