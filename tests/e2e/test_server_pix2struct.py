"""A tiny Deplot-style Pix2Struct behind `splitserve serve`, driven by the official `openai` client:
a chat message with a chart (data URL) and the Deplot prompt gives transformers' greedy reply (the
user's text is the rendered header; no chat template), streamed too; two images are a 400."""
from __future__ import annotations

import base64
import io

import openai
import pytest

from splitserve.models.pix2struct.processor import DEPLOT_PROMPT
from tests.e2e.conftest import DEFAULT_ARGS, ServerProcess
from tests.pix2struct_reference import NEW_TOKENS, bar_chart, hf_greedy, make_tiny_deplot


def data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def message(*images, text=DEPLOT_PROMPT):
    parts = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def deplot_server(tmp_path_factory):
    path, hf, processor = make_tiny_deplot(tmp_path_factory.mktemp("deplot-server") / "tiny-deplot")
    srv = ServerProcess(DEFAULT_ARGS + [path, "--max-num-batched-tokens", "256", "--attention-backend", "torch_ref"])
    try:
        srv.wait_healthy()
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield client, hf, processor
    finally:
        srv.stop()


def test_chart_chat_matches_transformers(deplot_server):
    client, hf, processor = deplot_server
    chart = bar_chart([0.2, 0.8, 0.5, 0.3], (100, 70))
    resp = client.chat.completions.create(model="tiny-deplot", messages=message(chart), max_tokens=NEW_TOKENS,
                                          temperature=0, extra_body={"ignore_eos": True})
    tokens, _ = hf_greedy(hf, processor, chart, DEPLOT_PROMPT)
    from splitserve.loading.resolve import load_tokenizer
    assert resp.choices[0].message.content == load_tokenizer(None).decode(tokens, skip_special_tokens=True)
    assert resp.usage.completion_tokens == NEW_TOKENS
    from tests.pix2struct_reference import hf_inputs
    patches = int(hf_inputs(processor, chart, DEPLOT_PROMPT)["attention_mask"].sum())
    assert resp.usage.prompt_tokens == patches + 1  # the encoder's patches and the decoder's start token
    stream = client.chat.completions.create(model="tiny-deplot", messages=message(chart), max_tokens=NEW_TOKENS,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == resp.choices[0].message.content


def test_two_images_are_a_400(deplot_server):
    client, _, _ = deplot_server
    chart = bar_chart([0.5], (40, 40))
    with pytest.raises(openai.BadRequestError, match="exactly one image"):
        client.chat.completions.create(model="tiny-deplot", messages=message(chart, chart), max_tokens=2)
