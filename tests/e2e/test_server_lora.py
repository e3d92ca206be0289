"""LoRA over HTTP, with the official `openai` client: adapters select by model name, /v1/models lists
them with the base model as parent, runtime load / unload (vLLM's endpoints and bodies) also while
requests run, refusals as 400 / 404, per-adapter request counts in /metrics.

The server runs a tiny random Llama; adapters are made by peft, and the reference is transformers
with the adapter merged (peft's merge_and_unload)."""
from __future__ import annotations

import concurrent.futures
import os

import httpx
import openai
import pytest
import torch

from tests.e2e.conftest import ServerProcess, metric_value
from tests.hf_reference import hf_greedy
from tests.lora_reference import make_peft_adapter, merged_reference

PROMPT = [5, 900, 77, 1200, 31, 450, 8, 2000]
NEW_TOKENS = 10
LONG_TOKENS = 60  # requests that are still running while adapters are loaded and unloaded


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from splitserve.loading.resolve import load_tokenizer
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("lora-adapters")
    paths = {name: make_peft_adapter(hf, root / name, rank=rank, alpha=2 * rank, seed=seed, magnitude=0.1)
             for name, rank, seed in (("a1", 8, 1), ("a2", 16, 2), ("a3", 8, 3))}
    make_peft_adapter(hf, root / "dora", rank=8, alpha=8, seed=4, use_dora=True)
    outside = tmp_path_factory.mktemp("elsewhere")
    make_peft_adapter(hf, outside / "x", rank=8, alpha=8, seed=5)
    tok = load_tokenizer(None)
    texts = {None: tok.decode(hf_greedy(hf, PROMPT, NEW_TOKENS)[0])}
    for name, path in paths.items():
        texts[name] = tok.decode(hf_greedy(merged_reference(hf, path), PROMPT, NEW_TOKENS)[0])
    assert len(set(texts.values())) == 4, "every adapter changes the output"
    texts["a1-long"] = tok.decode(hf_greedy(merged_reference(hf, paths["a1"]), PROMPT, LONG_TOKENS)[0])
    srv = ServerProcess(["--max-num-seqs", "8", "--disable-access-log", tiny_model_dir, "--served-model-name", "base", "--enable-lora",
                                        "--max-loras", "2", "--max-lora-rank", "16", "--lora-modules",
                                        f"a1={paths['a1']}", "--allow-runtime-lora", "--lora-allowed-dir",
                                        str(root)])
    try:
        srv.wait_healthy()
        yield srv, paths, texts, root, outside
    finally:
        srv.stop()


def complete(client, model, max_tokens=NEW_TOKENS):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text


@pytest.fixture(scope="module")
def client(setup):
    return openai.OpenAI(base_url=setup[0].url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(srv, path, body):
    return httpx.post(srv.url + path, json=body, timeout=60)


def test_models_lists_adapters_with_their_parent(setup, client):
    srv, paths, *_ = setup
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"base", "a1"}
    assert cards["a1"].parent == "base" and cards["a1"].root == os.path.abspath(paths["a1"])
    assert getattr(cards["base"], "parent", None) is None


def test_model_name_selects_the_adapter(setup, client):
    srv, paths, texts, *_ = setup
    assert complete(client, "a1") == texts["a1"]
    assert complete(client, "base") == texts[None]
    chat = client.chat.completions.create(model="a1", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.NotFoundError):
        complete(client, "no-such-adapter")


def test_runtime_load_unload_and_refusals(setup, client):
    srv, paths, texts, root, outside = setup
    r = post(srv, "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": paths["a2"]})
    assert r.status_code == 200, r.text
    assert complete(client, "a2") == texts["a2"]
    assert "a2" in {m.id for m in client.models.list().data}
    r = post(srv, "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": paths["a2"]})
    assert r.status_code == 400 and "already loaded" in r.text
    r = post(srv, "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": str(root / "dora")})
    assert r.status_code == 400 and "DoRA" in r.text
    r = post(srv, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(outside / "x")})
    assert r.status_code == 400 and "not under the allowed directory" in r.text
    r = post(srv, "/v1/load_lora_adapter", {"lora_name": "y", "lora_path": str(root / "missing")})
    assert r.status_code == 400 and "not a directory" in r.text
    assert post(srv, "/v1/unload_lora_adapter", {"lora_name": "a2"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(client, "a2")
    assert post(srv, "/v1/unload_lora_adapter", {"lora_name": "a2"}).status_code == 404


def test_load_and_unload_while_requests_run(setup, client):
    """Requests with a1 run while a3 is loaded and a1 unloaded: the running ones finish with a1's
    output; afterwards a1 is gone and a3 serves; loaded again, a1 is served again."""
    srv, paths, texts, *_ = setup
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        running = [pool.submit(complete, client, "a1", LONG_TOKENS) for _ in range(3)]
        assert post(srv, "/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": paths["a3"]}).status_code == 200
        base = pool.submit(complete, client, "base")
        with_a3 = pool.submit(complete, client, "a3")
        assert post(srv, "/v1/unload_lora_adapter", {"lora_name": "a1"}).status_code == 200
        assert [f.result() for f in running] == [texts["a1-long"]] * 3
        assert base.result() == texts[None] and with_a3.result() == texts["a3"]
    with pytest.raises(openai.NotFoundError):
        complete(client, "a1")
    assert post(srv, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": paths["a1"]}).status_code == 200
    assert complete(client, "a1") == texts["a1"]


def test_metrics_count_requests_per_adapter(setup, client):
    srv, *_ = setup
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    before = metric_value(text, "splitserve:lora_requests_total", {"lora_name": "a3"}) or 0
    complete(client, "a3", max_tokens=2)
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    assert metric_value(text, "splitserve:lora_requests_total", {"lora_name": "a3"}) == before + 1
