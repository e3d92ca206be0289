"""Sends benchmark requests to an OpenAI-compatible server and times the streamed replies.

Works the same against splitserve, vLLM, SGLang, trtllm-serve and llama.cpp: only the
standard /v1/completions and /v1/chat/completions streaming APIs are used, plus the widely
supported `ignore_eos` extension when --ignore-eos is given.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import httpx
import numpy as np

from splitserve.bench.datasets import BenchError, SampleRequest
from splitserve.bench.metrics import RequestResult

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
DONE = object()  # parse_sse_line's marker for "data: [DONE]"


@dataclass
class BenchConfig:
    base_url: str
    model: str
    endpoint: str = "completions"
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool = False
    temperature: float | None = None
    extra_body: dict = field(default_factory=dict)
    api_key: str | None = None
    request_timeout: float = 600.0
    disable_tqdm: bool = False


def normalize_base_url(url: str) -> str:
    """Accept http://host:port, with or without a trailing / or /v1, as people paste either."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise BenchError(f"--base-url {url!r} must start with http:// or https://")
    if url.endswith("/v1"):
        url = url[:-3]
    return url


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def check_server(base_url: str, api_key: str | None = None, timeout: float = 5.0) -> list[str]:
    """Fail fast, with a plain message, when nothing answers at base_url; return the served
    model ids (empty if the server has no /v1/models). Without this an unreachable URL would
    surface as N identical connection errors after the tokenizer and dataset were prepared."""
    # trust_env=False: a benchmark must time the server itself, never an HTTP proxy on the way.
    with httpx.Client(timeout=timeout, trust_env=False, headers=_headers(api_key)) as client:
        try:
            r = client.get(base_url + "/v1/models")
        except httpx.TimeoutException:
            raise BenchError(f"server at {base_url} did not answer within {timeout:g} s "
                             f"(GET /v1/models timed out); is it up and is the URL right?", 1) from None
        except httpx.HTTPError as e:
            raise BenchError(f"cannot reach server at {base_url}: {e or type(e).__name__}. "
                             f"Check --base-url and that the server is running.", 1) from None
        if r.status_code in (401, 403):
            raise BenchError(f"server at {base_url} refused the request (HTTP {r.status_code}); "
                             f"pass --api-key or set OPENAI_API_KEY", 1)
        if r.status_code == 200:
            try:
                return [m["id"] for m in r.json().get("data", []) if isinstance(m, dict) and "id" in m]
            except (ValueError, AttributeError):
                return []
        # Something answered but has no model list; /health tells us whether it is a server at all.
        try:
            h = client.get(base_url + "/health")
        except httpx.HTTPError:
            h = None
        if h is None or h.status_code >= 500:
            raise BenchError(f"server at {base_url} answered GET /v1/models with HTTP {r.status_code} "
                             f"and /health is not healthy; is this an OpenAI-compatible server?", 1)
        return []


def spec_decode_counters(base_url: str, api_key: str | None = None, timeout: float = 5.0) -> tuple[float, float] | None:
    """(verify steps, accepted draft tokens) from the server's /metrics (splitserve's or vLLM's
    spec_decode counters, summed over models), or None: no speculative decoding, or no /metrics."""
    try:
        text = httpx.get(base_url + "/metrics", headers=_headers(api_key), timeout=timeout).text
    except httpx.HTTPError:
        return None
    found: dict[str, float] = {}
    for line in text.splitlines():
        for prefix in ("splitserve:", "vllm:"):
            for name in ("spec_decode_num_drafts_total", "spec_decode_num_accepted_tokens_total"):
                if line.startswith(prefix + name + "{") or line.startswith(prefix + name + " "):
                    found[prefix + name] = found.get(prefix + name, 0.0) + float(line.rsplit(" ", 1)[1])
    for prefix in ("splitserve:", "vllm:"):
        if prefix + "spec_decode_num_drafts_total" in found:
            return (found[prefix + "spec_decode_num_drafts_total"],
                    found.get(prefix + "spec_decode_num_accepted_tokens_total", 0.0))
    return None


def acceptance_length(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """Mean tokens per verify step (accepted drafts + 1) between two readings of spec_decode_counters."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    return 1.0 + (after[1] - before[1]) / (after[0] - before[0])


def load_bench_tokenizer(spec: str):
    """--tokenizer: 'default' is splitserve's default model; anything else goes through
    splitserve's model resolver (local dir, .gguf, cached hub repo), then plain AutoTokenizer
    for tokenizer-only directories (no config.json) the resolver does not accept."""
    from splitserve.loading.resolve import load_tokenizer
    try:
        return load_tokenizer(None if spec == "default" else spec)
    except Exception as first:
        if os.path.isdir(spec):
            try:
                from transformers import AutoTokenizer
                return AutoTokenizer.from_pretrained(spec)
            except Exception:
                pass
        raise BenchError(f"cannot load tokenizer {spec!r}: {first}\n"
                         f"Pass --tokenizer PATH_OR_REPO (a local directory, a .gguf file or a repo in the "
                         f"Hugging Face cache), or --tokenizer default for splitserve's default model.") from None


def build_request(cfg: BenchConfig, sample: SampleRequest) -> tuple[str, dict]:
    """The URL and JSON body for one sample."""
    body: dict = {"model": sample.model or cfg.model, "max_tokens": sample.output_len, "stream": True,
                  # Ask for the server's token counts; they are exact where the client's re-tokenizing
                  # of the streamed text is only an estimate.
                  "stream_options": {"include_usage": True}}
    if cfg.endpoint == "chat":
        if sample.images:
            content = [{"type": "text", "text": sample.prompt}] + [
                {"type": "image_url", "image_url": {"url": uri}} for uri in sample.images]
        else:
            content = sample.prompt
        body["messages"] = [{"role": "user", "content": content}]
    else:
        body["prompt"] = sample.prompt
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.temperature is not None:
        body["temperature"] = cfg.temperature
    body.update(cfg.extra_body)
    return cfg.base_url + ENDPOINTS[cfg.endpoint], body


def parse_sse_line(line: str):
    """One line of an SSE stream: None (blank, comment, non-data field), DONE, or the JSON object.
    Raises ValueError for a data line that is not JSON."""
    line = line.strip()
    if not line.startswith("data:"):
        return None  # blank separator, ': keep-alive' comment, 'event:'/'id:' fields
    data = line[5:].strip()
    if data == "[DONE]":
        return DONE
    if not data:
        return None
    obj = json.loads(data)
    if not isinstance(obj, dict):
        raise ValueError(f"SSE data is not a JSON object: {data[:80]}")
    return obj


def _chunk_error(chunk: dict) -> str | None:
    """Servers report mid-stream failures differently: OpenAI/SGLang {"error": {...}}, vLLM
    {"object": "error", "message": ...}."""
    err = chunk.get("error")
    if err:
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    if chunk.get("object") == "error":
        return str(chunk.get("message", chunk))
    return None


def _chunk_text(chunk: dict, chat: bool) -> tuple[str, bool, bool]:
    """(output text, finish_reason seen, carries tokens) of one chunk. Reasoning text counts as
    output: the model spent decode steps on it. As vLLM's client does, every chunk with a choice
    counts as a token event, even with empty text (a token whose text the detokenizer holds back),
    except a chat stream's opening role chunk and a bare finish_reason."""
    choices = chunk.get("choices") or []
    if not choices:
        return "", False, False
    c = choices[0]
    if chat:
        delta = c.get("delta") or {}
        text = (delta.get("reasoning_content") or delta.get("reasoning") or "") + (delta.get("content") or "")
        tokens = "role" not in delta and (bool(text) or "content" in delta or c.get("logprobs") is not None)
    else:
        text = c.get("text") or ""
        tokens = bool(text) or c.get("finish_reason") is None or c.get("logprobs") is not None
    return text, c.get("finish_reason") is not None, tokens


async def send_request(client: httpx.AsyncClient, cfg: BenchConfig, sample: SampleRequest) -> RequestResult:
    url, body = build_request(cfg, sample)
    res = RequestResult(prompt_len=sample.prompt_len)
    parts: list[str] = []
    chat = cfg.endpoint == "chat"
    t0 = time.perf_counter()
    res.start = t0
    last = None
    ended = False  # [DONE] or a finish_reason arrived: the stream completed normally
    try:
        async with asyncio.timeout(cfg.request_timeout):
            async with client.stream("POST", url, json=body) as resp:
                if resp.status_code != 200:
                    raw = (await resp.aread()).decode("utf-8", "replace")
                    res.error = f"HTTP {resp.status_code}: {_error_text(raw)}"
                    return _done(res, t0)
                async for line in resp.aiter_lines():
                    now = time.perf_counter()
                    try:
                        chunk = parse_sse_line(line)
                    except ValueError:
                        res.error = f"malformed stream data: {line.strip()[:120]}"
                        return _done(res, t0)
                    if chunk is None:
                        continue
                    if chunk is DONE:
                        ended = True
                        break
                    if (err := _chunk_error(chunk)) is not None:
                        res.error = f"server error in stream: {err}"
                        return _done(res, t0)
                    usage = chunk.get("usage")
                    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                        res.output_len = int(usage["completion_tokens"])
                        res.prompt_len = int(usage.get("prompt_tokens") or res.prompt_len)
                        res.usage_reported = True
                    text, finished, tokens = _chunk_text(chunk, chat)
                    ended = ended or finished
                    # As vLLM's client: the first chunk that carries a token is the first token, even
                    # with empty text (a token the detokenizer holds back, or, with random weights, an
                    # id outside the tokenizer's vocabulary); a chat stream's role chunk is none.
                    if tokens:
                        if last is None:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
                        parts.append(text)
    except TimeoutError:
        res.error = f"request timed out after {cfg.request_timeout:g} s"
        return _done(res, t0)
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return _done(res, t0)
    res = _done(res, t0)
    if not ended:
        res.error = "stream ended without [DONE] or a finish_reason (connection cut?)"
    elif last is None:
        # No token ever arrived, so TTFT/TPOT do not exist; counting it as a success would also
        # inflate request throughput with a request that decoded nothing.
        res.error = "empty completion: no output text was streamed"
    else:
        res.success = True
        res.generated_text = "".join(parts)
    return res


def _done(res: RequestResult, t0: float) -> RequestResult:
    res.e2e = time.perf_counter() - t0
    return res


def _error_text(raw: str) -> str:
    """The message inside an error body if it is OpenAI-style JSON, else the body itself."""
    try:
        obj = json.loads(raw)
        if isinstance(obj, dict):
            err = obj.get("error", obj)
            if isinstance(err, dict):
                return str(err.get("message") or err.get("detail") or obj)[:200]
            return str(obj.get("message") or obj.get("detail") or err)[:200]
    except ValueError:
        pass
    return " ".join(raw.split())[:200] or "(empty body)"


def arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send times (s after the start) of n requests.

    Gaps are gamma-distributed with mean 1/rate and shape `burstiness`: shape 1 is the
    exponential, i.e. Poisson arrivals; below 1 arrivals bunch into bursts, above 1 they even
    out (the gaps' coefficient of variation is 1/sqrt(burstiness)). rate inf sends everything
    at once. The first request goes at 0.
    """
    if n <= 0:
        return np.zeros(0)
    if not rate > 0:
        raise BenchError(f"--request-rate must be positive (or inf), got {rate}")
    if not burstiness > 0:
        raise BenchError(f"--burstiness must be positive, got {burstiness}")
    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


Sender = Callable[[SampleRequest], Awaitable[RequestResult]]


def make_client(cfg: BenchConfig) -> httpx.AsyncClient:
    # No pool limit: --max-concurrency is the only cap on requests in flight, so a pool limit
    # must not silently add its own queueing (counted as server latency).
    return httpx.AsyncClient(
        timeout=httpx.Timeout(cfg.request_timeout, connect=30.0), trust_env=False,
        headers=_headers(cfg.api_key), limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


async def run_requests(cfg: BenchConfig, samples: list[SampleRequest], rng: np.random.Generator,
                       sender: Sender) -> tuple[list[RequestResult], float]:
    """Send samples on the arrival schedule, at most cfg.max_concurrency at a time; return the
    results in sample order and the duration (first send to last reply)."""
    from tqdm import tqdm

    offsets = arrival_offsets(len(samples), cfg.request_rate, cfg.burstiness, rng)
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    bar = tqdm(total=len(samples), disable=cfg.disable_tqdm, unit="req", dynamic_ncols=True)
    output_tokens = 0

    def progress(result: RequestResult | None) -> None:
        nonlocal output_tokens
        if result is not None and result.success:
            # Tokens by the server's usage where it came, else by stream events (exact counts come
            # after the run: fill_token_counts).
            output_tokens += result.output_len if result.usage_reported else len(result.itl) + 1
        if not bar.disable:
            elapsed = max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"{output_tokens / elapsed:.1f} output tok/s", refresh=False)
        bar.update(1)

    async def one(sample: SampleRequest) -> RequestResult:
        result = None
        try:
            if sem is None:
                result = await sender(sample)
            else:
                async with sem:  # TTFT is timed from here, after any wait for a free slot
                    result = await sender(sample)
        except Exception as e:  # a client bug must show up as a counted failure, not vanish
            result = RequestResult(error=f"client error: {type(e).__name__}: {e}")
        finally:
            progress(result)
        return result

    start = time.perf_counter()
    tasks = []
    for sample, offset in zip(samples, offsets):
        # Absolute deadlines, so time spent creating tasks does not stretch the schedule.
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(sample)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    for r in results:
        r.start = max(0.0, r.start - start) if r.start else 0.0
    return list(results), duration


def fill_token_counts(results: list[RequestResult], tokenizer) -> None:
    """Count output tokens with the tokenizer where the server reported no usage. Done after
    the run, not per chunk, so tokenizing never competes with timing on the event loop."""
    for r in results:
        if r.success and not r.usage_reported:
            r.output_len = len(tokenizer.encode(r.generated_text, add_special_tokens=False)) if tokenizer else len(r.itl) + 1


async def _run(cfg: BenchConfig, sample_sets: list[list[SampleRequest]], rates: list[float], seed: int,
               test_request: bool) -> list[tuple[list[RequestResult], float]]:
    async with make_client(cfg) as client:
        if test_request and sample_sets and sample_sets[0]:
            first = sample_sets[0][0]
            r = await send_request(client, cfg, first)
            if not r.success:
                raise BenchError(f"the test request failed, so the benchmark was not started: {r.error}\n"
                                 f"(check --model, --endpoint and the server's log; --no-test-request skips this check)", 1)
        runs = []
        for samples, rate in zip(sample_sets, rates):
            run_cfg = BenchConfig(**{**cfg.__dict__, "request_rate": rate})
            runs.append(await run_requests(run_cfg, samples, np.random.default_rng(seed),
                                           lambda s, c=run_cfg: send_request(client, c, s)))
        return runs


def benchmark(cfg: BenchConfig, samples: list[SampleRequest], tokenizer, seed: int = 0,
              rates: list[float] | None = None, test_request: bool = True
              ) -> list[tuple[list[RequestResult], float]]:
    """Run the samples once per request rate (default: cfg.request_rate) and return
    (results, duration) per rate. The same samples and the same arrival seed are used for every
    rate, so runs differ only in load."""
    rates = rates if rates is not None else [cfg.request_rate]
    runs = asyncio.run(_run(cfg, [samples] * len(rates), rates, seed, test_request))
    for results, _ in runs:
        fill_token_counts(results, tokenizer)
    return runs


def results_to_json(results: list[RequestResult]) -> list[dict]:
    return [{"success": r.success, "error": r.error or None, "start": r.start, "prompt_len": r.prompt_len,
             "output_len": r.output_len, "usage_reported": r.usage_reported, "ttft": r.ttft if r.success else None,
             "tpot": r.tpot, "e2e": r.e2e, "itl": r.itl} for r in results]
