"""A vLLM command line, unchanged, against a real server on the tiny model (CPU): it serves chat through
the openai client; the model's generation_config.json sets the sampling defaults (temperature 0 here,
so a request without one is greedy, equal to transformers' greedy) and requests override them;
`--generation-config vllm` turns them off; the endpoints vLLM has (/v1/models/{id}, /ping, /load,
/docs, CORS); the metrics under vLLM's names and the periodic stats line.
"""
from __future__ import annotations

import json
import shutil
import time

import httpx
import jinja2
import openai
import pytest
import torch

from conftest import ServerProcess, metric_value
from tests.hf_reference import hf_greedy

KEY = "vllm-style-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
NAMES = ("smol-a", "smol-b")
# A template of our own, unlike the tokenizer's, so the tests can tell it was used.
TEMPLATE = ("{% for m in messages %}### {{ m.role | upper }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}### ASSISTANT:{% endif %}")
SECRET = "zebra-quartz-secret"  # a word of a prompt that must never reach the log
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model, with a generation config that recommends greedy decoding (and repeats
    transformers' default top_k 50, which must not turn top-k on)."""
    d = tmp_path_factory.mktemp("gen-config-model") / "model"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**cfg, "temperature": 0.0, "top_k": 50}))
    return str(d)


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return str(path)


def vllm_command_line(model_dir: str, template_file: str, generation_config: str) -> list[str]:
    return [model_dir, "--served-model-name", *NAMES, "--max-model-len", "256", "--gpu-memory-utilization", "0.8",
            "--enable-prefix-caching", "--seed", "1234", "--chat-template", template_file,
            "--generation-config", generation_config, "--api-key", KEY,
            # and a few more of vLLM's
            "--uvicorn-log-level", "info", "--disable-uvicorn-access-log", "--enable-log-requests",
            "--allowed-origins", '["http://ok.example"]', "--metrics-compat", "vllm", "--dtype", "float"]


@pytest.fixture(scope="module")
def srv(model_dir, template_file):
    s = ServerProcess(vllm_command_line(model_dir, template_file, "auto"))
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": f"Say {SECRET} twice."}]


def prompt_ids(tokenizer) -> list[int]:
    """The prompt as our template renders it (jinja2 directly, not the server's code)."""
    text = jinja2.Template(TEMPLATE).render(messages=MESSAGES, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def chat_tokens(client, **kw) -> tuple[list[str], list[float]]:
    r = client.chat.completions.create(model=NAMES[1], messages=MESSAGES, max_tokens=NEW_TOKENS, logprobs=True,
                                       extra_body={"ignore_eos": True}, **kw)
    assert r.model == NAMES[0] and r.choices[0].finish_reason == "length"
    content = r.choices[0].logprobs.content
    return [c.token for c in content], [c.logprob for c in content]


def test_the_template_of_the_command_line_is_used(srv, tokenizer):
    r = httpx.post(srv.url + "/tokenize", json={"model": NAMES[0], "messages": MESSAGES}, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == prompt_ids(tokenizer)


def test_generation_config_makes_requests_greedy(client, tokenizer, hf_model):
    ref_tokens, ref_logprobs = hf_greedy(hf_model, prompt_ids(tokenizer), NEW_TOKENS)
    tokens, logprobs = chat_tokens(client)  # no temperature: the model's 0.0
    assert tokens == [tokenizer.decode([t]) for t in ref_tokens]
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-3)


def test_a_request_overrides_the_generation_config(client, tokenizer, hf_model):
    ref_tokens, _ = hf_greedy(hf_model, prompt_ids(tokenizer), NEW_TOKENS)
    greedy = [tokenizer.decode([t]) for t in ref_tokens]
    hot, _ = chat_tokens(client, temperature=1.0, seed=3)
    assert hot != greedy
    assert chat_tokens(client, temperature=1.0, seed=3)[0] == hot  # seeded: the same again


def test_generation_config_vllm_turns_the_defaults_off(srv, client, model_dir, template_file):
    """With `--generation-config vllm` a request without temperature samples at 1.0: the same tokens
    as temperature 1.0 asked for explicitly on the server that has the defaults."""
    explicit, _ = chat_tokens(client, temperature=1.0, seed=3)
    other = ServerProcess(vllm_command_line(model_dir, template_file, "vllm"))
    try:
        other.wait_healthy()
        c = openai.OpenAI(base_url=other.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        assert chat_tokens(c, seed=3)[0] == explicit
    finally:
        other.stop()


def test_the_port_is_bound_before_the_model_loads(srv):
    log = srv.log_tail(10_000).splitlines()
    bound = next(i for i, line in enumerate(log) if "bound 127.0.0.1:" in line)
    built = next(i for i, line in enumerate(log) if "model built" in line)
    assert bound < built


def test_models_endpoints(srv):
    r = httpx.get(srv.url + "/v1/models", headers=AUTH)
    assert [m["id"] for m in r.json()["data"]] == list(NAMES)
    for name in NAMES:
        r = httpx.get(srv.url + f"/v1/models/{name}", headers=AUTH)
        assert r.status_code == 200 and r.json()["id"] == name and r.json()["max_model_len"] == 256
    r = httpx.get(srv.url + "/v1/models/no-such/model", headers=AUTH)
    assert r.status_code == 404
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "model_not_found"
    assert "no-such/model" in err["message"]
    assert httpx.get(srv.url + f"/v1/models/{NAMES[0]}").status_code == 401


def test_probe_and_browser_endpoints(srv):
    assert httpx.get(srv.url + "/ping").status_code == 200
    assert httpx.post(srv.url + "/ping").status_code == 200
    assert httpx.get(srv.url + "/load").json() == {"server_load": 0}
    assert httpx.get(srv.url + "/get_load").json() == {"load": 0}  # SGLang's shape, polled by vllm-router
    assert httpx.get(srv.url + "/favicon.ico").status_code == 204
    docs = httpx.get(srv.url + "/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    schema = httpx.get(srv.url + "/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/models/{model_id}", "/ping", "/load"} <= set(schema["paths"])


def test_cors(srv):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(srv.url + "/v1/chat/completions", headers={"Origin": "http://ok.example", **preflight})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ok.example"
    r = httpx.options(srv.url + "/v1/chat/completions", headers={"Origin": "http://evil.example", **preflight})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(srv.url + "/v1/models", headers={"Origin": "http://ok.example", **AUTH})
    assert r.headers["access-control-allow-origin"] == "http://ok.example"


def metrics(srv) -> str:
    return httpx.get(srv.url + "/metrics", timeout=10).text


def test_metrics_of_one_request_under_both_names(srv):
    """A fresh 20-token prompt and 5 output tokens: one prefill step of 20 tokens and 4 decode steps
    of one (the last token is never run), all under splitserve: and vllm: names alike."""
    rng = torch.Generator().manual_seed(77)
    prompt = torch.randint(1000, 40000, (20,), generator=rng).tolist()  # shares no cached block
    before = metrics(srv)
    r = httpx.post(srv.url + "/v1/completions", headers=AUTH, timeout=120,
                   json={"model": NAMES[0], "prompt": prompt, "max_tokens": 5, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    after = metrics(srv)
    for prefix in ("splitserve:", "vllm:"):
        def delta(name, **labels):
            return metric_value(after, prefix + name, labels) - (metric_value(before, prefix + name, labels) or 0)
        assert delta("iteration_tokens_total_sum") == 20 + 4
        assert delta("iteration_tokens_total_count") == 5
        assert delta("request_success_total", finished_reason="length") == 1
        assert delta("request_params_n_sum") == 1
        for phase in ("queue", "prefill", "decode", "inference"):
            assert delta(f"request_{phase}_time_seconds_count") == 1, phase
        assert metric_value(after, prefix + "cache_config_info",
                            {"block_size": "16", "enable_prefix_caching": "True"}) == 1
        assert metric_value(after, prefix + "num_preemptions_total") == 0
        assert metric_value(after, prefix + "prefix_cache_queries_total") > 0


def test_stats_line_and_request_log(srv, client):
    chat_tokens(client, temperature=0)
    deadline = time.monotonic() + 60
    while "Avg generation throughput" not in srv.log_tail(10_000) and time.monotonic() < deadline:
        time.sleep(0.5)
    log = srv.log_tail(10_000)
    assert "Avg prompt throughput" in log and "Running:" in log and "KV cache usage:" in log, log[-3000:]
    line = next(line for line in log.splitlines() if "request chatcmpl-" in line)
    assert "prompt of" in line and "tokens" in line and "temperature=" in line
    assert SECRET not in log  # prompts are never logged
