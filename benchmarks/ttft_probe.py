"""Where the time to first token goes on an idle server: one request at a time, streamed.

    python benchmarks/ttft_probe.py http://127.0.0.1:8011 --tokenizer DIR [--n 20] [--len 1024]

For each prompt kind (the same random text as `bench serve`'s random dataset, the same prompt as
token ids, and a 16-token text prompt) it sends --n requests one after another (max_tokens 2) and
prints the client's median TTFT beside the server's mean TTFT over the same requests (from
/metrics): their difference is the HTTP side (parsing, tokenization, the first event's way out);
text against token ids is the tokenization alone.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_breakdown import sums_and_counts  # noqa: E402

from splitserve.bench.datasets import _PromptMaker  # noqa: E402
from splitserve.loading.resolve import load_tokenizer  # noqa: E402


def server_ttft(client: httpx.Client, url: str) -> tuple[float, float]:
    m = sums_and_counts(client.get(url + "/metrics").text)
    key = "splitserve:time_to_first_token_seconds"
    return m.get(key + "_sum", 0.0), m.get(key + "_count", 0.0)


def first_token_time(client: httpx.Client, url: str, model: str, prompt) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "stream": True, "ignore_eos": True}
    t0, ttft = time.perf_counter(), None
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():  # read to the end: the next request finds the server idle
            if ttft is None and line.startswith("data: ") and line[6:] != "[DONE]" \
                    and json.loads(line[6:]).get("choices"):
                ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError(f"no token came back (HTTP {r.status_code})")
    return ttft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("url")
    ap.add_argument("--tokenizer", default=None, help="the server's tokenizer directory (default: the default model's)")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--len", type=int, default=1024)
    args = ap.parse_args()
    url = args.url.rstrip("/")
    tok = load_tokenizer(args.tokenizer)
    maker = _PromptMaker(tok, np.random.default_rng(123))
    with httpx.Client(timeout=60, trust_env=False) as client:
        model = client.get(url + "/v1/models").json()["data"][0]["id"]
        kinds = {"text": lambda: maker.text(args.len)[0], "token ids": lambda: maker.ids(args.len),
                 "text, 16 tokens": lambda: maker.text(16)[0]}
        first_token_time(client, url, model, "warm up")
        for name, make in kinds.items():
            prompts = [make() for _ in range(args.n)]
            s0, c0 = server_ttft(client, url)
            times = [first_token_time(client, url, model, p) for p in prompts]
            s1, c1 = server_ttft(client, url)
            server = (s1 - s0) / max(c1 - c0, 1)
            med = statistics.median(times)
            print(f"{name:16s} client TTFT median {med * 1e3:7.2f} ms, server mean {server * 1e3:7.2f} ms, "
                  f"HTTP side ~{(med - server) * 1e3:6.2f} ms")


if __name__ == "__main__":
    main()
