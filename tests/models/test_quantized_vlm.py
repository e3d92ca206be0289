"""A LLaVA checkpoint whose language model is FP8 (compressed-tensors FP8_DYNAMIC, vision tower and
projector ignored, as llm-compressor's VLM recipes write them): the decoder runs quantized, the
vision side stays float, and splitserve matches transformers on the same checkpoint."""
import json
import shutil

import pytest
import torch
import transformers

from splitserve import LLM, SamplingParams
from tests.multimodal_reference import hf_processor, make_tiny_llava_dir, mm_tokenizer, random_image
from tests.quant_reference import compare_greedy, quantize_hf_model, save_compressed

NEW_TOKENS = 10
IGNORE = ["lm_head", "re:.*vision_tower.*", "re:.*multi_modal_projector.*"]
PROMPTS = [("USER: <image>\nWhat is shown here? ASSISTANT:", [(80, 60)]),
           ("Tell me a story about a robot.", []),
           ("Compare <image> with <image> please.", [(50, 90), (64, 64)])]


@torch.inference_mode()
def hf_greedy_mm_logprobs(model, inputs: dict, max_new_tokens: int):
    n = inputs["input_ids"].shape[1]
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    return out.sequences[0, n:].tolist(), torch.stack([torch.log_softmax(s[0].float(), -1) for s in out.scores])


def test_fp8_llava_language_model_quantized_vision_float(tmp_path):
    tokenizer = mm_tokenizer()
    float_dir = make_tiny_llava_dir(tmp_path / "float", tokenizer, tower="clip", seed=3)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(float_dir, dtype=torch.float32).eval()
    quantize_hf_model(model, "FP8_DYNAMIC", [], ignore=IGNORE)
    path = save_compressed(model, str(tmp_path / "fp8"), tokenizer)
    # compressed-tensors saves the ignore list as the names it sees (`language_model.lm_head`,
    # `vision_tower.encoder...`), which transformers itself then fails to match to its modules when
    # loading the checkpoint back; recipes' own regexes match every spelling.
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg["quantization_config"]["ignore"] = IGNORE
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)
    for name in ("preprocessor_config.json",):
        shutil.copy(f"{float_dir}/{name}", f"{path}/{name}")

    llm = LLM(path, num_blocks=128, max_num_batched_tokens=48)
    assert llm.engine.config.model.quantization.startswith("compressed-tensors: FP8 per-channel weights")
    vlm = llm.engine.runner.model
    assert vlm.language_model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert vlm.vision_tower.encoder.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    assert not vlm.vision_tower.encoder.layers[0].self_attn.qkv_proj.is_quantized
    assert not vlm.multi_modal_projector.linear_1.is_quantized and not vlm.language_model.lm_head.is_quantized

    hf = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processor = hf_processor(path, tokenizer, "clip", False)
    images = [[random_image(10 * i + j, size) for j, size in enumerate(sizes)] for i, (_, sizes) in enumerate(PROMPTS)]
    requests = [{"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text
                for (text, _), imgs in zip(PROMPTS, images)]
    outs = llm.generate(requests, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    whole = 0
    for (text, _), imgs, out in zip(PROMPTS, images, outs):
        inputs = processor(text=text, images=imgs or None, return_tensors="pt")
        assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
        ref_tokens, ref_lp = hf_greedy_mm_logprobs(hf, dict(inputs), NEW_TOKENS)
        got = out.outputs[0]
        whole += compare_greedy(got.token_ids, [lp[t] for lp, t in zip(got.logprobs, got.token_ids)],
                                ref_tokens, ref_lp, tol=0.1)
    assert whole >= 2
    assert llm.engine.kv_manager.pool.is_whole()
