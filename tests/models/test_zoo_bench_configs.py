"""The benchmark configs of BLIP-2 OPT-2.7B, BLIP-2 Flan-T5-XL and Fuyu-8B: the real-size config builds a model of
transformers' parameter count (both on the meta device), and the tiny one (config.json merged with
tiny_overrides.json) serves a token-id prompt where `mm_processor.placeholder_id` marks one image,
the contract benchmarks/vlm_bench.py uses."""
import json
import os
import shutil

import pytest
import torch
import transformers

from splitserve import LLM, SamplingParams
from tests.multimodal_reference import random_image

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "configs")
MODELS = {"blip2-opt-2.7b": "Blip2ForConditionalGeneration", "fuyu-8b": "FuyuForCausalLM",
          "blip2-flan-t5-xl": "Blip2ForConditionalGeneration"}
DECODER_ONLY = ["blip2-opt-2.7b", "fuyu-8b"]  # (BLIP-2 T5's tiny serving: tests/models/test_blip2_t5.py)


def merged(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def tiny_dir(name: str, dst) -> str:
    src = os.path.join(CONFIGS, name)
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(src, "tiny_overrides.json")) as g:
        cfg = merged(json.load(f), json.load(g))
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    for file in os.listdir(src):
        if file not in ("config.json", "tiny_overrides.json"):
            shutil.copy(os.path.join(src, file), dst)
    return str(dst)


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", [n for n in MODELS if os.path.isdir(os.path.join(CONFIGS, n))])
def test_real_size_parameter_count_matches_transformers(name):
    from splitserve.loading.hf_config import expose_text_config
    from splitserve.models.registry import get_model_class
    path = os.path.join(CONFIGS, name)
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        ref = getattr(transformers, MODELS[name])(config)
    expose_text_config(config)
    _, cls = get_model_class(config.architectures, config)
    with torch.device("meta"):
        ours = cls(config)
    assert count(ours) == count(ref)


@pytest.mark.parametrize("name", DECODER_ONLY)
def test_tiny_config_serves_a_token_id_prompt_with_one_image(name, tmp_path):
    llm = LLM(tiny_dir(name, tmp_path / name), random_weights=True, num_blocks=256, block_size=16)
    mm = llm.engine.mm_processor
    prompt = [5, 6, 7, mm.placeholder_id, 8, 9]
    out = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": random_image(0, (336, 336))}},
                       SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    assert len(out.prompt_token_ids) > len(prompt) and llm.engine.runner.mm.num_images_encoded == 1
    assert llm.engine.kv_manager.pool.is_whole()
