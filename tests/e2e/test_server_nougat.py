"""A tiny Nougat behind `splitserve serve`, driven by the official `openai` client: a chat message
whose only part is a page image (data URL) gives transformers' greedy reply, streamed too; the
non-streamed choice carries the markdown post-processing; usage counts the encoder's positions and
the decoder's start token; two images are a 400."""
from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import DEFAULT_ARGS, ServerProcess
from tests.e2e.test_server_pix2struct import data_url
from tests.nougat_reference import NEW_TOKENS, hf_greedy, make_tiny_nougat, text_page


def message(*pages, text=None):
    parts = [{"type": "image_url", "image_url": {"url": data_url(p)}} for p in pages]
    return [{"role": "user", "content": parts + ([{"type": "text", "text": text}] if text else [])}]


@pytest.fixture(scope="module")
def nougat_server(tmp_path_factory):
    path, hf, processor = make_tiny_nougat(tmp_path_factory.mktemp("nougat-server") / "tiny-nougat")
    srv = ServerProcess(DEFAULT_ARGS + [path, "--max-num-batched-tokens", "128", "--attention-backend", "torch_ref"])
    try:
        srv.wait_healthy()
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield client, hf, processor
    finally:
        srv.stop()


def test_page_chat_matches_transformers(nougat_server):
    from transformers import NougatTokenizer

    from splitserve.loading.resolve import load_tokenizer
    client, hf, processor = nougat_server
    page = text_page(["A page for the server", "with two lines"])
    resp = client.chat.completions.create(model="tiny-nougat", messages=message(page), max_tokens=NEW_TOKENS,
                                          temperature=0, extra_body={"ignore_eos": True})
    text = load_tokenizer(None).decode(hf_greedy(hf, processor, page)[0], skip_special_tokens=True)
    choice = resp.choices[0]
    assert choice.message.content == text
    assert choice.model_extra["markdown"] == NougatTokenizer().post_process_generation(text)
    assert resp.usage.completion_tokens == NEW_TOKENS
    assert resp.usage.prompt_tokens == 12 + 1  # the encoder's 4 x 3 positions and the decoder start token
    stream = client.chat.completions.create(model="tiny-nougat", messages=message(page, text="Convert to markdown"),
                                            max_tokens=NEW_TOKENS, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text  # text is no input
    assert chunks[-1].usage.prompt_tokens == 13


def test_two_pages_are_a_400(nougat_server):
    client, _, _ = nougat_server
    page = text_page(["x"])
    with pytest.raises(openai.BadRequestError, match="exactly one image"):
        client.chat.completions.create(model="tiny-nougat", messages=message(page, page), max_tokens=2)
