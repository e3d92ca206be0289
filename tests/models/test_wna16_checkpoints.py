"""W4A16 / W8A16 checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized) of tiny random Llamas,
written offline (tests/wna16_reference.py): splitserve (the torch reference path on CPU: canonical
layout dequantized, float32 matmul) vs transformers running the dequantized weights (GPTQ / AWQ)
or compressed-tensors' own fake quantization (pack-quantized). Greedy tokens equal, logprobs close."""
import random

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.loading.resolve import load_tokenizer
from tests.quant_reference import compare_greedy, hf_greedy_logprobs
from tests.wna16_reference import make_gptq_or_awq, make_pack_quantized

NEW_TOKENS = 12
# Weight-only: both sides run the same float32 weights, so only summation order differs.
TOL = 0.02


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def random_prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


def assert_matches(llm, ref, prompts):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    whole = 0
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        ref_tokens, ref_lp = hf_greedy_logprobs(ref, prompt, NEW_TOKENS)
        got = out.outputs[0]
        whole += compare_greedy(got.token_ids, [lp[t] for lp, t in zip(got.logprobs, got.token_ids)],
                                ref_tokens, ref_lp, TOL)
    assert whole >= len(prompts) - 1


def check_layers(llm, bits, group, zeros: bool, act_order: bool):
    """Every shard layout was converted to the canonical layout with the expected parts."""
    model = llm.engine.runner.model
    layer = model.layers[0]
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        names = {n for n, _ in lin.named_parameters()}
        assert names == {"qweight", "scales"} | ({"zeros"} if zeros else set()) | ({"perm"} if act_order else set())
        assert lin.qweight.shape == (lin.in_features * bits // 32, lin.out_features)
        assert lin.wna16_group_size == (lin.in_features if group == -1 else group)
    assert model.lm_head.weight.dtype == torch.float32


GPTQ_CASES = [  # bits, group, symmetric, desc_act, checkpoint_format
    (4, 128, True, False, "gptq"),
    (4, 32, False, True, "gptq"),
    (8, 64, True, True, "gptq"),
    (4, 64, False, False, "gptq_v2"),
]


@pytest.mark.parametrize("bits,group,sym,desc_act,ckpt_fmt", GPTQ_CASES)
def test_gptq_checkpoint_matches_dequantized_reference(bits, group, sym, desc_act, ckpt_fmt, tokenizer, tmp_path):
    path, ref = make_gptq_or_awq(tmp_path / "gptq", tokenizer, "gptq", bits, group, sym, desc_act, ckpt_fmt,
                                 seed=bits + group)
    llm = LLM(path, num_blocks=64, max_num_batched_tokens=64)
    assert llm.engine.config.model.quantization == f"gptq: W{bits}A16 (group {group})"
    check_layers(llm, bits, group, zeros=not sym, act_order=desc_act)
    assert_matches(llm, ref, random_prompts(len(tokenizer), 4, seed=group))


@pytest.mark.parametrize("group", [64, 128])
def test_awq_checkpoint_matches_dequantized_reference(group, tokenizer, tmp_path):
    path, ref = make_gptq_or_awq(tmp_path / "awq", tokenizer, "awq", 4, group, symmetric=False, seed=group)
    llm = LLM(path, num_blocks=64, max_num_batched_tokens=64)
    assert llm.engine.config.model.quantization == f"awq: W4A16 (group {group})"
    check_layers(llm, 4, group, zeros=True, act_order=False)
    assert_matches(llm, ref, random_prompts(len(tokenizer), 4, seed=group + 1))


CT_CASES = [(4, 32, True), (4, 128, False), (8, 64, True), (8, 128, False), (4, -1, True)]


@pytest.mark.parametrize("bits,group,sym", CT_CASES)
def test_pack_quantized_checkpoint_matches_transformers(bits, group, sym, tokenizer, tmp_path):
    path, ref = make_pack_quantized(tmp_path / "ct", tokenizer, bits, group, sym, seed=bits * 7 + group)
    llm = LLM(path, num_blocks=64, max_num_batched_tokens=64)
    label = "per-channel" if group == -1 else f"group {group}"
    assert llm.engine.config.model.quantization == \
        f"compressed-tensors: W{bits}A16 ({label}, {'symmetric' if sym else 'asymmetric'})"
    check_layers(llm, bits, group, zeros=not sym, act_order=False)
    assert_matches(llm, ref, random_prompts(len(tokenizer), 4, seed=bits + group))


def test_mismatched_shape_names_the_tensor(tokenizer, tmp_path):
    def tamper(key, value):
        if key == "model.layers.1.self_attn.k_proj.scales":
            value = value[:, :-8]
        return key, value
    path, _ = make_gptq_or_awq(tmp_path / "bad", tokenizer, "gptq", 4, 128, tamper=tamper)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.scales.*shape"):
        LLM(path, num_blocks=16)


def test_shards_with_different_g_idx_are_refused(tokenizer, tmp_path):
    def tamper(key, value):
        if key == "model.layers.0.mlp.up_proj.g_idx":
            value = value.flip(0)
        return key, value
    path, _ = make_gptq_or_awq(tmp_path / "gidx", tokenizer, "gptq", 4, 64, desc_act=True, tamper=tamper)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.g_idx.*differs"):
        LLM(path, num_blocks=16)


def test_unsupported_gptq_settings_are_clear_errors(tokenizer, tmp_path):
    from splitserve.layers.quantization.wna16 import AWQConfig, GPTQConfig
    with pytest.raises(ValueError, match="3-bit"):
        GPTQConfig.from_checkpoint({"quant_method": "gptq", "bits": 3, "group_size": 128})
    with pytest.raises(ValueError, match="marlin"):
        GPTQConfig.from_checkpoint({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"})
    with pytest.raises(ValueError, match="GEMM"):
        AWQConfig.from_checkpoint({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"})
    path, _ = make_gptq_or_awq(tmp_path / "g", tokenizer, "gptq", 4, 128)
    with pytest.raises(ValueError, match="quantized with 'gptq'"):
        LLM(path, quantization="awq", num_blocks=16)
