"""A vision-language model behind `splitserve serve`, driven by the official `openai` client.

The served model is a tiny random LLaVA (CLIP tower); the expected reply comes from transformers
on the same checkpoint. Media rules: data: URLs are accepted, file:// only under
--allowed-local-media-path, http(s) not at all without --allowed-media-domains, at most
--limit-mm-per-prompt images; anything else is a 400 that says why.
"""
from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
import torch
import transformers

from tests.e2e.conftest import DEFAULT_ARGS, ServerProcess
from tests.multimodal_reference import hf_greedy_mm, hf_processor, make_tiny_llava_dir, mm_tokenizer, random_image

MAX_TOKENS = 6


def data_url(img, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(*urls: str, text: str = "What is in this picture?") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    tok = mm_tokenizer()
    root = tmp_path_factory.mktemp("vlm-server")
    path = make_tiny_llava_dir(root / "tiny-llava", tok, "clip", False, seed=11)
    media = root / "media"
    media.mkdir()
    random_image(5, (60, 60)).save(media / "allowed.png")
    srv = ServerProcess(DEFAULT_ARGS + [path, "--max-model-len", "1024", "--limit-mm-per-prompt", "image=2",
                                        "--allowed-local-media-path", str(media)])
    try:
        srv.wait_healthy()
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield srv, client, path, tok, media
    finally:
        srv.stop()


def reference_reply(path, tok, messages_text: list[dict], images) -> tuple[str, int]:
    """HF greedy reply text and prompt length for the chat template with <image> markers."""
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    text = tok.apply_chat_template(messages_text, add_generation_prompt=True, tokenize=False)
    inputs = hf_processor(path, tok, "clip", False)(text=text, images=images, return_tensors="pt",
                                                    add_special_tokens=False)
    tokens, _ = hf_greedy_mm(hf, dict(inputs), MAX_TOKENS)
    return tok.decode(tokens, skip_special_tokens=True), inputs["input_ids"].shape[1]


def test_image_chat_through_the_openai_client(vlm):
    srv, client, path, tok, _ = vlm
    img = random_image(1, (80, 64))
    resp = client.chat.completions.create(model="tiny-llava", messages=image_message(data_url(img)),
                                          max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})
    want_text, want_prompt_len = reference_reply(
        path, tok, [{"role": "user", "content": "<image>\nWhat is in this picture?"}], [img])
    assert resp.choices[0].message.content == want_text
    assert resp.usage.prompt_tokens == want_prompt_len  # image placeholders counted
    assert resp.usage.completion_tokens == MAX_TOKENS


def test_allowed_local_file_is_accepted(vlm):
    srv, client, _, _, media = vlm
    resp = client.chat.completions.create(model="tiny-llava", messages=image_message(f"file://{media}/allowed.png"),
                                          max_tokens=2, temperature=0)
    assert resp.choices[0].finish_reason in ("length", "stop")


def _bad(client, messages) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-llava", messages=messages, max_tokens=2)
    assert e.value.status_code == 400
    return e.value.body["message"] if isinstance(e.value.body, dict) else str(e.value)


def test_bad_images_are_400_with_a_reason(vlm, tmp_path):
    _, client, _, _, media = vlm
    not_png = "data:image/png;base64," + base64.b64encode(b"definitely not an image").decode()
    assert "could not be decoded" in _bad(client, image_message(not_png))
    assert "base64" in _bad(client, image_message("data:image/png;base64,@@@not-base64@@@"))
    from PIL import Image
    huge = Image.new("RGB", (8000, 6000))  # 48 Mpx, tiny as a PNG: a decompression bomb
    assert "pixels" in _bad(client, image_message(data_url(huge)))


def test_too_many_images_is_400(vlm):
    _, client, _, _, _ = vlm
    url = data_url(random_image(2, (32, 32)))
    assert "too many images" in _bad(client, image_message(url, url, url))


def test_disallowed_sources_are_400(vlm, tmp_path):
    _, client, _, _, media = vlm
    outside = tmp_path / "outside.png"
    random_image(3, (32, 32)).save(outside)
    assert "outside the allowed" in _bad(client, image_message(f"file://{outside}"))
    assert "outside the allowed" in _bad(client, image_message(f"file://{media}/../{outside.name}"))
    assert "not allowed" in _bad(client, image_message("http://example.com/cat.png"))
    assert "not allowed" in _bad(client, image_message("https://example.com/cat.png"))


def test_video_and_a_bare_placeholder_id_are_400_for_llava(vlm):
    """LLaVA takes no video; a token-id prompt holding its image token without an image is refused."""
    srv, client, _, tok, _ = vlm
    with pytest.raises(openai.BadRequestError, match="does not accept videos"):
        client.chat.completions.create(model="tiny-llava", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}])
    ids = tok.encode("Look", add_special_tokens=False) + [tok.convert_tokens_to_ids("<image>")]
    with pytest.raises(openai.BadRequestError, match="no image or video was given"):
        client.completions.create(model="tiny-llava", max_tokens=2, prompt=ids)
    assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
