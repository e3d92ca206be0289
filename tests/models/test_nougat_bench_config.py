"""The Nougat benchmark config (benchmarks/configs/nougat-base: facebook/nougat-base's geometry, Swin
896 x 672 with patches of 4 and windows of 7, depths 2-2-14-2; mBART 10 layers of width 1024, 4096
positions, 50,000 tokens): the real-size config builds a model of transformers' parameter count on the
meta device, and the tiny one serves a token-id prompt where `mm_processor.placeholder_id` marks the
page (the contract of benchmarks/vlm_bench.py) with 28 x 21 encoder positions."""
import os

import torch
import transformers

from splitserve import LLM, SamplingParams
from tests.models.test_zoo_bench_configs import CONFIGS, count, tiny_dir
from tests.nougat_reference import text_page


def test_real_size_parameter_count_matches_transformers():
    from splitserve.models.registry import get_model_class
    config = transformers.AutoConfig.from_pretrained(os.path.join(CONFIGS, "nougat-base"))
    with torch.device("meta"):
        ref = transformers.VisionEncoderDecoderModel(config=config)
    _, cls = get_model_class(config.architectures, config)
    with torch.device("meta"):
        ours = cls(config)
    assert count(ours) == count(ref)
    assert 340e6 < count(ours) < 360e6  # nougat-base: about 350M parameters


def test_tiny_config_serves_a_token_id_prompt_with_one_page(tmp_path):
    llm = LLM(tiny_dir("nougat-base", tmp_path / "nougat"), random_weights=True, num_blocks=128, block_size=16)
    mm = llm.engine.mm_processor
    page = text_page(["A benchmark page", "of a few lines"], size=(400, 520))
    out = llm.generate({"prompt_token_ids": [mm.placeholder_id], "multi_modal_data": {"image": page}},
                       SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4 and out.num_encoder_tokens == 28 * 21
    assert llm.engine.kv_manager.pool.is_whole()
