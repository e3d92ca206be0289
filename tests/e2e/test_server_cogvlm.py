"""CogVLM behind `splitserve serve`, driven by the official `openai` client: a tiny checkpoint with
the real tensor names (remote-code config); the expected reply comes from the plain-torch reference
of the published code (tests/cogvlm_reference.py)."""
from __future__ import annotations

import openai
import pytest

from tests.cogvlm_reference import ReferenceCogVLM, make_tiny_cogvlm_dir
from tests.e2e.conftest import DEFAULT_ARGS, ServerProcess
from tests.e2e.test_server_vlm import data_url
from tests.multimodal_reference import mm_tokenizer, random_image

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def cogvlm(tmp_path_factory):
    tok = mm_tokenizer()
    path = make_tiny_cogvlm_dir(tmp_path_factory.mktemp("cogvlm-server") / "tiny-cogvlm", tok, seed=8)
    srv = ServerProcess(DEFAULT_ARGS + [path])
    try:
        srv.wait_healthy()
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120), path, tok
    finally:
        srv.stop()


def test_image_chat_through_the_openai_client(cogvlm):
    client, path, tok = cogvlm
    img = random_image(3, (100, 70))
    content = [{"type": "image_url", "image_url": {"url": data_url(img)}}, {"type": "text", "text": "What is it?"}]
    resp = client.chat.completions.create(model="tiny-cogvlm", messages=[{"role": "user", "content": content}],
                                          max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    # The chat template's text with the image part's marker taken out; the image follows BOS.
    rendered = tok.apply_chat_template([{"role": "user", "content": "<image>\nWhat is it?"}],
                                       add_generation_prompt=True, tokenize=False)
    text = rendered.replace("<image>", "", 1)
    tokens, _, ids = ReferenceCogVLM(path).greedy(tok, text, img, MAX_TOKENS)
    assert resp.choices[0].message.content == tok.decode(tokens, skip_special_tokens=True)
    assert resp.usage.prompt_tokens == len(ids)


def test_two_images_are_a_400(cogvlm):
    client, _, _ = cogvlm
    content = [{"type": "image_url", "image_url": {"url": data_url(random_image(i, (60, 60)))}} for i in (4, 5)]
    with pytest.raises(openai.BadRequestError, match="one image"):
        client.chat.completions.create(model="tiny-cogvlm", messages=[{"role": "user", "content": content}],
                                       max_tokens=2)
