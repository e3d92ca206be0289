"""A text-only T5 behind `splitserve serve`, driven by the official `openai` client: /v1/completions
(plain and streamed) gives transformers' greedy reply for the encoder input; a prompt too long for
the encoder's step is a 400 that says why."""
from __future__ import annotations

import openai
import pytest
import torch
import transformers

from splitserve.loading.resolve import load_tokenizer
from tests.e2e.conftest import DEFAULT_ARGS, ServerProcess
from tests.t5_reference import hf_t5_greedy, make_tiny_t5

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def t5_server(tmp_path_factory):
    tok = load_tokenizer(None)
    path = make_tiny_t5(tmp_path_factory.mktemp("t5-server") / "tiny-t5", tok, seed=3, feed_forward_proj="gated-gelu")
    srv = ServerProcess(DEFAULT_ARGS + [path, "--max-num-batched-tokens", "256", "--attention-backend", "torch_ref"])
    try:
        srv.wait_healthy()
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield client, path, tok
    finally:
        srv.stop()


def _reference(path, tok, prompt: str) -> str:
    hf = transformers.T5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    tokens, _ = hf_t5_greedy(hf, tok.encode(prompt, add_special_tokens=True), MAX_TOKENS)
    return tok.decode(tokens, skip_special_tokens=True)


def test_completions_match_transformers(t5_server):
    client, path, tok = t5_server
    prompt = "translate English to German: The house is wonderful."
    resp = client.completions.create(model="tiny-t5", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].text == _reference(path, tok, prompt)
    assert resp.usage.completion_tokens == MAX_TOKENS
    # usage counts what the user sent: the encoder's tokens, and the decoder's start token
    assert resp.usage.prompt_tokens == len(tok.encode(prompt, add_special_tokens=True)) + 1
    stream = client.completions.create(model="tiny-t5", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True},
                                       stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == resp.choices[0].text
    assert {c.usage.prompt_tokens for c in chunks if c.usage} == {resp.usage.prompt_tokens}


def test_encoder_input_too_long_is_a_400(t5_server):
    client, _, _ = t5_server
    with pytest.raises(openai.BadRequestError, match="encoder"):
        client.completions.create(model="tiny-t5", prompt=" x" * 400, max_tokens=2)
