"""The benchmark configs vlm_bench.py --suite adds (LLaVA-NeXT-7B, Kosmos-2, VILA1.5-7B, a NeVA of
Nemotron-8B shape): real-size parameter counts equal transformers' where transformers has the
model (meta device), and each tiny config (write_tiny_config, per-file overrides for VILA's and
NeVA's directory layouts) serves a token-id prompt with one image; CogVLM's language model alone
(--text-model) is a Llama of CogVLM's text shape."""
import json
import os

import pytest
import torch
import transformers

from benchmarks.vlm_bench import write_text_model_config, write_tiny_config
from splitserve import LLM, SamplingParams
from tests.multimodal_reference import random_image

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "configs")


# LLaVA's features come from the tower's second-to-last layer: its last layer and post-layernorm are
# never built here (transformers builds them and leaves them unused).
UNUSED = {"llava-next-7b": ("model.vision_tower.encoder.layers.23.",
                            "model.vision_tower.post_layernorm."), "kosmos-2": ()}


@pytest.mark.parametrize("name,hf_class", [("llava-next-7b", "LlavaNextForConditionalGeneration"),
                                           ("kosmos-2", "Kosmos2ForConditionalGeneration")])
def test_real_size_parameter_count_matches_transformers(name, hf_class):
    from splitserve.loading.hf_config import expose_text_config
    from splitserve.models.registry import get_model_class
    config = transformers.AutoConfig.from_pretrained(os.path.join(CONFIGS, name))
    with torch.device("meta"):
        ref = getattr(transformers, hf_class)(config)
    expose_text_config(config)
    _, cls = get_model_class(config.architectures, config)
    with torch.device("meta"):
        ours = cls(config)
    used = sum(p.numel() for n, p in ref.named_parameters() if not n.startswith(UNUSED[name]))
    assert sum(p.numel() for p in ours.parameters()) == used


@pytest.mark.parametrize("name", ["llava-next-7b", "kosmos-2", "vila1.5-7b", "neva-8b"])
def test_tiny_config_serves_a_token_id_prompt_with_one_image(name, tmp_path):
    llm = LLM(write_tiny_config(os.path.join(CONFIGS, name), str(tmp_path / name)), random_weights=True,
              num_blocks=256, block_size=16, max_model_len=2048)
    mm = llm.engine.mm_processor
    prompt = [1, mm.placeholder_id, 8, 9]
    out = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": random_image(0, (336, 336))}},
                       SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    assert len(out.prompt_token_ids) > len(prompt) and llm.engine.runner.mm.num_images_encoded == 1
    assert llm.engine.kv_manager.pool.is_whole()


def test_cogvlm_language_model_alone_is_its_llama(tmp_path):
    tiny = write_tiny_config(os.path.join(CONFIGS, "cogvlm-17b"), str(tmp_path / "cogvlm"))
    text = write_text_model_config(tiny, str(tmp_path / "text"))
    with open(os.path.join(tiny, "config.json")) as f, open(os.path.join(text, "config.json")) as g:
        cog, llama = json.load(f), json.load(g)
    assert llama["architectures"] == ["LlamaForCausalLM"] and "vision_config" not in llama
    assert all(llama[k] == cog[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
    llm = LLM(text, random_weights=True, num_blocks=64, block_size=16)
    out = llm.generate({"prompt_token_ids": [1, 5, 6, 7]}, SamplingParams(max_tokens=3, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
