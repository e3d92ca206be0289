"""vLLM's request parameters on a real server (the tiny model, CPU): prompt_logprobs and echo with
logprobs vs transformers' log-softmax over the same prompt (prefilled in chunks of 16 tokens),
stream_options.continuous_usage_stats through the openai client, truncate_prompt_tokens, the
top_logprobs cap, priority (with --scheduling-policy priority, and refused without it) and user."""
from __future__ import annotations

import httpx
import openai
import pytest
import torch

from conftest import ServerProcess

BUDGET = 16
MAX_LEN = 256
LONG = "The quick brown fox jumps over the lazy dog while the cat sleeps on a warm windowsill today."


def command(model_dir: str, *extra: str) -> list[str]:
    return [model_dir, "--max-model-len", str(MAX_LEN), "--max-num-batched-tokens", str(BUDGET),
            "--max-num-seqs", "8", "--dtype", "float", "--disable-access-log", *extra]


@pytest.fixture(scope="module")
def srv(tiny_model_dir):
    s = ServerProcess(command(tiny_model_dir, "--scheduling-policy", "priority"))
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_logprobs(tiny_model_dir):
    """ids -> [len(ids) - 1, vocab] log-softmax rows (row i predicts ids[i + 1]), from transformers."""
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    @torch.inference_mode()
    def run(ids: list[int]) -> torch.Tensor:
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)[:-1]
    return run


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=120)


def check_prompt_logprobs(got: list, ids: list[int], ref: torch.Tensor, k: int, tokenizer) -> None:
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        entry, row, token = got[i], ref[i - 1], ids[i]
        top_vals, top_ids = row.topk(k)
        assert set(entry) == {str(t) for t in top_ids.tolist()} | {str(token)}
        assert entry[str(token)]["logprob"] == pytest.approx(row[token].item(), abs=1e-3)
        # its rank, up to tokens whose logprobs lie within float error of its own
        assert int((row > row[token] + 1e-4).sum()) + 1 <= entry[str(token)]["rank"] <= int((row > row[token] - 1e-4).sum()) + 1
        assert entry[str(token)]["decoded_token"] == tokenizer.decode([token])
        for t, v in zip(top_ids.tolist(), top_vals.tolist()):
            assert entry[str(t)]["logprob"] == pytest.approx(v, abs=1e-3)


def test_completion_prompt_logprobs_match_transformers(srv, tokenizer, hf_logprobs):
    ids = tokenizer.encode(LONG)
    assert len(ids) > BUDGET  # prefilled in chunks
    r = post(srv, "/v1/completions", {"prompt": LONG, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    check_prompt_logprobs(r.json()["choices"][0]["prompt_logprobs"], ids, hf_logprobs(ids), 2, tokenizer)


def test_chat_prompt_logprobs_are_the_whole_requests(srv, tokenizer, hf_logprobs):
    messages = [{"role": "user", "content": LONG}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    r = post(srv, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    check_prompt_logprobs(r.json()["prompt_logprobs"], ids, hf_logprobs(ids), 0, tokenizer)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


def test_prompt_logprobs_are_not_streamed(srv):
    r = post(srv, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    r = post(srv, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "prompt_logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_echo_with_logprobs(client, tokenizer, hf_logprobs):
    ids = tokenizer.encode(LONG)
    r = client.completions.create(model=None, prompt=LONG, echo=True, logprobs=1, max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.text.startswith(LONG) and len(c.text) > len(LONG)
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + 3 and lp.tokens[:len(ids)] == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    ref = hf_logprobs(ids)
    assert lp.token_logprobs[1:len(ids)] == pytest.approx([ref[i - 1, ids[i]].item() for i in range(1, len(ids))],
                                                          abs=1e-3)
    for i in range(1, len(ids)):  # the prompt token and the top one
        best = ref[i - 1].argmax().item()
        assert lp.top_logprobs[i][tokenizer.decode([best])] == pytest.approx(ref[i - 1, best].item(), abs=1e-3)
    assert lp.text_offset == sorted(lp.text_offset)
    # Streamed: the prompt's chunk comes first with its logprobs, then the same tokens as above.
    chunks = list(client.completions.create(model=None, prompt=LONG, echo=True, logprobs=1, max_tokens=3,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].text == LONG
    assert chunks[0].choices[0].logprobs.token_logprobs == lp.token_logprobs[:len(ids)]
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text


def test_continuous_usage_in_every_chunk(client, tokenizer):
    options = {"include_usage": True, "continuous_usage_stats": True}
    n_prompt = len(tokenizer.encode("Count to ten:"))
    chunks = list(client.completions.create(model=None, prompt="Count to ten:", max_tokens=6, temperature=0,
                                            stream=True, stream_options=options, extra_body={"ignore_eos": True}))
    with_choices = [ch for ch in chunks if ch.choices]
    assert with_choices and all(ch.usage is not None for ch in with_choices)
    done = [ch.usage.completion_tokens for ch in with_choices]
    assert done == sorted(done) and done[-1] == 6
    assert all(ch.usage.prompt_tokens == n_prompt and ch.usage.total_tokens == n_prompt + ch.usage.completion_tokens
               for ch in with_choices)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6

    chat = list(client.chat.completions.create(model=None, messages=[{"role": "user", "content": "Count to ten"}],
                                               max_tokens=5, temperature=0, stream=True, stream_options=options,
                                               extra_body={"ignore_eos": True}))
    with_choices = [ch for ch in chat if ch.choices]
    assert with_choices[0].usage.completion_tokens == 0  # the role chunk, before any token
    assert [ch.usage.completion_tokens for ch in with_choices][-1] == 5
    assert len({ch.usage.prompt_tokens for ch in with_choices}) == 1 and chat[-1].usage.completion_tokens == 5
    # Without continuous_usage_stats only the last chunk carries usage.
    plain = list(client.completions.create(model=None, prompt="Count to ten:", max_tokens=3, stream=True,
                                           stream_options={"include_usage": True}))
    assert all(ch.usage is None for ch in plain[:-1]) and plain[-1].usage.completion_tokens == 3


def test_truncate_prompt_tokens_keeps_the_last_tokens(srv, tokenizer):
    ids = tokenizer.encode(LONG)
    body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = post(srv, "/v1/completions", {**body, "prompt": LONG, "truncate_prompt_tokens": 5})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 5
    same = post(srv, "/v1/completions", {**body, "prompt": ids[-5:]}).json()
    assert r.json()["choices"][0]["text"] == same["choices"][0]["text"]
    # A prompt over the context is cut to fit; a cut longer than the context is refused.
    too_long = (ids * 40)[:MAX_LEN + 50]
    r = post(srv, "/v1/completions", {**body, "prompt": too_long, "truncate_prompt_tokens": 10})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 10
    r = post(srv, "/v1/completions", {**body, "prompt": LONG, "truncate_prompt_tokens": MAX_LEN + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
    r = post(srv, "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": LONG}],
                                           "truncate_prompt_tokens": 7})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 7
    r = post(srv, "/v1/completions", {**body, "prompt": LONG, "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_top_logprobs_cap(client, srv):
    messages = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model=None, messages=messages, max_tokens=2, logprobs=True, top_logprobs=20)
    assert all(len(t.top_logprobs) == 20 for t in r.choices[0].logprobs.content)
    for bad in (21, -1):
        r = post(srv, "/v1/chat/completions", {"messages": messages, "logprobs": True, "top_logprobs": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = post(srv, "/v1/completions", {"prompt": "Hi", "logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_priority_and_user_are_accepted(client):
    r = client.chat.completions.create(model=None, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       user="someone", extra_body={"priority": -5})
    assert r.choices[0].finish_reason in ("length", "stop")


def test_priority_needs_the_priority_policy(tiny_model_dir):
    s = ServerProcess(command(tiny_model_dir))
    try:
        s.wait_healthy()
        r = post(s, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "priority": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        assert "--scheduling-policy priority" in r.json()["error"]["message"]
        assert post(s, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "priority": 0}).status_code == 200
    finally:
        s.stop()
