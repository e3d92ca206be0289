"""BLIP-2 with a T5 language model behind `splitserve serve`, driven by the official `openai` client:
an image chat gives transformers' greedy reply (the rendered chat template with the image's query
tokens is the encoder's input), streamed too."""
from __future__ import annotations

import openai
import torch
import transformers

from tests.e2e.conftest import DEFAULT_ARGS, ServerProcess
from tests.e2e.test_server_vlm import data_url, image_message
from tests.models.test_blip2_t5 import NEW_TOKENS, reference, t5_text_config
from tests.multimodal_reference import mm_tokenizer, random_image
from tests.zoo_reference import blip2_processor, make_tiny_blip2_dir


def test_blip2_t5_image_chat_through_the_openai_client(tmp_path):
    tok = mm_tokenizer()
    path = make_tiny_blip2_dir(tmp_path / "tiny-blip2-t5", tok, seed=6, text_config=t5_text_config(tok))
    hf = transformers.Blip2ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    img = random_image(4, (72, 64))
    text = tok.apply_chat_template([{"role": "user", "content": "<image>\nWhat is in this picture?"}],
                                   add_generation_prompt=True, tokenize=False)
    # a rendered template carries its own special tokens
    want, _, encoder_len = reference((path, tok, hf, blip2_processor(path, tok)), text, img, add_special_tokens=False)
    srv = ServerProcess(DEFAULT_ARGS + [path, "--attention-backend", "torch_ref"])
    try:
        srv.wait_healthy()
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        kw = dict(model="tiny-blip2-t5", messages=image_message(data_url(img)), max_tokens=NEW_TOKENS, temperature=0,
                  extra_body={"ignore_eos": True})
        resp = client.chat.completions.create(**kw)
        assert resp.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
        assert resp.usage.completion_tokens == NEW_TOKENS
        # the prompt the user sent: the encoder's input (query tokens and text) and the decoder start
        assert resp.usage.prompt_tokens == encoder_len + 1
        stream = client.chat.completions.create(**kw, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == resp.choices[0].message.content
    finally:
        srv.stop()
