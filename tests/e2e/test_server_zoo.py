"""BLIP-2 (OPT) and Fuyu behind `splitserve serve`, each driven by the official `openai` client; the
expected reply comes from transformers on the same tiny random checkpoint."""
from __future__ import annotations

import openai
import pytest
import torch
import transformers

from tests.e2e.conftest import DEFAULT_ARGS, ServerProcess
from tests.e2e.test_server_vlm import data_url, image_message
from tests.multimodal_reference import mm_tokenizer, random_image

MAX_TOKENS = 6


def serve(path):
    srv = ServerProcess(DEFAULT_ARGS + [path, "--max-model-len", "1024", "--limit-mm-per-prompt", "image=2"])
    srv.wait_healthy()
    return srv, openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_blip2_image_chat_through_the_openai_client(tmp_path):
    from tests.models.test_blip2 import expanded_ids
    from tests.zoo_reference import hf_greedy, make_tiny_blip2_dir
    tok = mm_tokenizer()
    path = make_tiny_blip2_dir(tmp_path / "tiny-blip2", tok, seed=12)
    img = random_image(1, (80, 64))
    text = tok.apply_chat_template([{"role": "user", "content": "<image>\nWhat is in this picture?"}],
                                   add_generation_prompt=True, tokenize=False)
    hf = transformers.Blip2ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    pixels = transformers.AutoImageProcessor.from_pretrained(path)(images=[img], return_tensors="pt")["pixel_values"]
    ids = expanded_ids(tok, text, add_special_tokens=False)  # a rendered template carries its own specials
    want, _ = hf_greedy(hf, MAX_TOKENS, input_ids=torch.tensor([ids]), pixel_values=pixels)
    srv, client = serve(path)
    try:
        resp = client.chat.completions.create(model="tiny-blip2", messages=image_message(data_url(img)),
                                              max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        assert resp.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
        assert resp.usage.prompt_tokens == len(ids)
    finally:
        srv.stop()


def test_fuyu_image_chat_through_the_openai_client(tmp_path):
    from tests.zoo_reference import fuyu_reference_inputs, fuyu_tokenizer, hf_greedy, make_tiny_fuyu_dir
    tok = fuyu_tokenizer()
    path = make_tiny_fuyu_dir(tmp_path / "tiny-fuyu", tok, seed=13)
    img = random_image(2, (70, 40))
    text = tok.apply_chat_template([{"role": "user", "content": "<image>\nWhat is in this picture?"}],
                                   add_generation_prompt=True, tokenize=False)
    # the image part stands where the template put its marker: the image's rows there, no BOS/<0x04>
    before, after = text.split("<image>")
    one = fuyu_reference_inputs(path, tok, "", img)
    run = one["input_ids"][0].tolist()
    ids = (tok.encode(before, add_special_tokens=False) + run[:run.index(tok.bos_token_id)]
           + tok.encode(after, add_special_tokens=False))
    hf = transformers.FuyuForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want, _ = hf_greedy(hf, MAX_TOKENS, input_ids=torch.tensor([ids]), pixel_values=one["pixel_values"])
    srv, client = serve(path)
    try:
        resp = client.chat.completions.create(model="tiny-fuyu", messages=image_message(data_url(img)),
                                              max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        assert resp.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
        assert resp.usage.prompt_tokens == len(ids)
    finally:
        srv.stop()


@pytest.mark.slow  # a third server start: keeps the file's fast tier under a minute
def test_kosmos2_grounding_through_the_openai_client(tmp_path):
    """A chat with an image and a choice constraint that forces location tokens: the reply's text
    keeps them, and the choice's extra `grounding` field is transformers' post-processing of it."""
    from tests.models.test_kosmos2 import GROUNDED
    from tests.zoo_reference import make_tiny_kosmos2_dir
    path, proc = make_tiny_kosmos2_dir(tmp_path / "tiny-kosmos2", seed=14)
    srv, client = serve(path)
    try:
        resp = client.chat.completions.create(
            model="tiny-kosmos2", messages=image_message(data_url(random_image(3, (64, 64))), text="<grounding> Look"),
            max_tokens=40, temperature=0, extra_body={"structured_outputs": {"choice": [GROUNDED]}})
        choice = resp.choices[0]
        assert "<patch_index_0044>" in choice.message.content
        cleaned, entities = proc.post_process_generation(choice.message.content)
        grounding = choice.model_extra["grounding"]
        assert grounding["text"] == cleaned
        assert [(e["phrase"], tuple(e["span"]), [tuple(b) for b in e["boxes"]]) for e in grounding["entities"]] == \
            [(p, tuple(s), [tuple(b) for b in boxes]) for p, s, boxes in entities]
        # text-only requests to the same server carry it too (no entities)
        plain = client.completions.create(model="tiny-kosmos2", prompt="Hello there", max_tokens=3, temperature=0)
        assert plain.choices[0].model_extra["grounding"]["entities"] == []
    finally:
        srv.stop()
