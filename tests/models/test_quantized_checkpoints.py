"""Quantized checkpoints written offline by compressed-tensors, and the same weights in the
DeepSeek-style `fp8` and NVIDIA ModelOpt layouts: splitserve (emulated on CPU) vs transformers
running the compressed-tensors checkpoint (its decompressed weights, its own activation QDQ).
Greedy tokens equal, logprobs close."""
import random

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.loading.resolve import load_tokenizer
from tests.quant_reference import (compare_greedy, hf_greedy_logprobs, make_compressed_llama_dir, to_deepseek_fp8,
                                   to_modelopt_fp8)

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def random_prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def assert_matches_hf(llm, hf, prompts, tol=0.1):
    """Greedy parity up to near-ties (compare_greedy); at least half the sequences agree to the end
    (the tiny random models are flat: near-ties are common)."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    whole = 0
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_lp = hf_greedy_logprobs(hf, prompt, NEW_TOKENS)
        got = out.outputs[0]
        whole += compare_greedy(got.token_ids, [lp[t] for lp, t in zip(got.logprobs, got.token_ids)],
                                ref_tokens, ref_lp, tol)
    assert whole >= len(prompts) // 2
    assert llm.engine.kv_manager.pool.is_whole()


# preset -> (what splitserve must say it runs, the parameters of a merged QKV layer)
PRESETS = {
    "FP8": ("FP8 per-tensor weights, static per-tensor activations", {"weight", "weight_scale", "input_scale"}),
    "FP8_DYNAMIC": ("FP8 per-channel weights, dynamic per-token activations", {"weight", "weight_scale"}),
    "FP8_BLOCK": ("FP8 128x128-block weights, dynamic per-token-group (128) activations", {"weight", "weight_scale"}),
    "W8A8": ("W8A8 INT8, per-channel weights, dynamic per-token activations", {"weight", "weight_scale"}),
}


@pytest.fixture(scope="module")
def checkpoints(tokenizer, tmp_path_factory):
    calibration = random_prompts(len(tokenizer), 4, seed=7)
    root = tmp_path_factory.mktemp("quant")
    return {p: make_compressed_llama_dir(root / p, tokenizer, p, calibration, seed=i) for i, p in enumerate(PRESETS)}


@pytest.mark.parametrize("preset", list(PRESETS))
def test_compressed_tensors_checkpoint_matches_transformers(preset, checkpoints, tokenizer):
    path = checkpoints[preset]
    llm = LLM(path, num_blocks=64, max_num_batched_tokens=64)
    label, params = PRESETS[preset]
    assert llm.engine.config.model.quantization == f"compressed-tensors: {label}"
    layer = llm.engine.runner.model.layers[0]
    qkv = layer.self_attn.qkv_proj
    assert {n for n, _ in qkv.named_parameters()} == params
    assert qkv.weight.dtype == (torch.int8 if preset == "W8A8" else torch.float8_e4m3fn)
    assert llm.engine.runner.model.lm_head.weight.dtype == torch.float32  # ignored by the recipe
    if preset == "FP8":
        # per-tensor scales of q, k and v differ; each shard keeps its own (spread per channel)
        q, k, v = qkv.split(qkv.weight_scale)
        assert len({q.unique().item(), k.unique().item(), v.unique().item()}) == 3
    assert_matches_hf(llm, hf_model(path), random_prompts(len(tokenizer), 6, seed=1))


def test_deepseek_style_block_fp8_checkpoint(checkpoints, tokenizer, tmp_path):
    """quant_method fp8 + weight_block_size + weight_scale_inv: the FP8_BLOCK weights re-spelled."""
    ct = checkpoints["FP8_BLOCK"]
    path = to_deepseek_fp8(ct, str(tmp_path / "deepseek"))
    llm = LLM(path, num_blocks=64, max_num_batched_tokens=64)
    assert llm.engine.config.model.quantization.startswith("fp8: FP8 128x128-block weights")
    assert "weight_scale_inv" in dict(llm.engine.runner.model.layers[0].mlp.gate_up_proj.named_parameters())
    assert_matches_hf(llm, hf_model(ct), random_prompts(len(tokenizer), 4, seed=2))


def test_modelopt_fp8_checkpoint(checkpoints, tokenizer, tmp_path):
    """hf_quant_config.json, scalar per-tensor scales, KV-cache scales left unused."""
    ct = checkpoints["FP8"]
    path = to_modelopt_fp8(ct, str(tmp_path / "modelopt"))
    llm = LLM(path, quantization="modelopt", num_blocks=64, max_num_batched_tokens=64)
    assert llm.engine.config.model.quantization == "modelopt: FP8 per-tensor weights, static per-tensor activations"
    assert_matches_hf(llm, hf_model(ct), random_prompts(len(tokenizer), 4, seed=3))


def test_quantized_checkpoint_with_unknown_tensor_fails_naming_it(checkpoints, tmp_path):
    from tests.quant_reference import _rewrite

    def rename(key, value):
        yield key, value
        if key == "model.layers.1.mlp.down_proj.weight_scale":
            yield "model.layers.1.mlp.down_proj.weight_global_scale", value[:1].clone()

    path = _rewrite(checkpoints["FP8_DYNAMIC"], str(tmp_path / "extra"), rename, lambda cfg, d: None)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight_global_scale"):
        LLM(path, num_blocks=16)


def test_flag_naming_another_format_is_refused(checkpoints):
    with pytest.raises(ValueError, match="quantized with 'compressed-tensors'"):
        LLM(checkpoints["FP8_DYNAMIC"], quantization="fp8", num_blocks=16)


@pytest.mark.parametrize("preset", ["FP8", "FP8_BLOCK", "W8A8"])
def test_random_weights_fill_quantized_storage(preset, checkpoints):
    """Benchmarks run quantized formats without their weights: each method draws its own storage
    and scales (a float N(0, 0.02) quantized as the format does)."""
    llm = LLM(checkpoints[preset], random_weights=True, num_blocks=16)
    down = llm.engine.runner.model.layers[1].mlp.down_proj
    scale = down.weight_scale
    assert torch.isfinite(scale).all() and (scale > 0).all() and scale.max() < 1
    assert down.weight.float().abs().max() > 10  # the quantized range is used
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_online_fp8_with_random_weights(tmp_path, tokenizer):
    from tests.hf_reference import make_tiny_llama_dir
    path = make_tiny_llama_dir(tmp_path / "float", tokenizer, num_kv_heads=2, tie=False)
    llm = LLM(path, random_weights=True, quantization="fp8", num_blocks=16)
    qkv = llm.engine.runner.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and (qkv.weight_scale > 0).all()
    assert len(llm.generate([[5, 6]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids) == 3
