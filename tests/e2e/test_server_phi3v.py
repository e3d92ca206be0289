"""Phi-3-vision behind `splitserve serve`, driven by the official `openai` client: a tiny checkpoint
in the real layout (remote-code config, no transformers processor); the expected reply comes from
the independent reference in tests/phi3v_reference.py."""
from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import DEFAULT_ARGS, ServerProcess
from tests.e2e.test_server_vlm import data_url
from tests.multimodal_reference import random_image
from tests.phi3v_reference import ReferencePhi3V, make_tiny_phi3v_dir, phi3v_tokenizer

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def phi3v(tmp_path_factory):
    tok = phi3v_tokenizer()
    path = make_tiny_phi3v_dir(tmp_path_factory.mktemp("phi3v-server") / "tiny-phi3v", tok, num_crops=4, seed=4)
    srv = ServerProcess(DEFAULT_ARGS + [path, "--limit-mm-per-prompt", "image=3"])
    try:
        srv.wait_healthy()
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield client, path, tok
    finally:
        srv.stop()


def test_two_image_chat_through_the_openai_client(phi3v):
    client, path, tok = phi3v
    imgs = [random_image(1, (150, 60)), random_image(2, (64, 64))]
    content = [{"type": "image_url", "image_url": {"url": data_url(imgs[0])}},
               {"type": "image_url", "image_url": {"url": data_url(imgs[1])}},
               {"type": "text", "text": "Which one is brighter?"}]
    resp = client.chat.completions.create(model="tiny-phi3v", messages=[{"role": "user", "content": content}],
                                          max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    text = "<|user|>\n<|image_1|>\n<|image_2|>\nWhich one is brighter?<|end|>\n<|assistant|>\n"
    tokens, _, ids = ReferencePhi3V(path).greedy(tok, text, imgs, MAX_TOKENS)
    assert resp.choices[0].message.content == tok.decode(tokens, skip_special_tokens=True)
    assert resp.usage.prompt_tokens == len(ids)


def test_misnumbered_marker_is_a_400(phi3v):
    client, _, _ = phi3v
    content = [{"type": "image_url", "image_url": {"url": data_url(random_image(3, (60, 60)))}},
               {"type": "text", "text": "and <|image_2|> too"}]
    with pytest.raises(openai.BadRequestError, match="mixes"):
        client.chat.completions.create(model="tiny-phi3v", messages=[{"role": "user", "content": content}],
                                       max_tokens=2)
