"""Every decoder family vs transformers on the same random weights, through the real engine (CPU,
torch_ref attention): greedy tokens equal, logprobs close. Tiny configs with at least 2 layers, GQA
where the family has it, and prompts longer than the sliding window where there is one. Llama,
Mistral and Qwen2 are in test_llama_parity.py and test_sliding_window_parity.py."""
import random

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.loading.resolve import load_tokenizer
from tests.hf_reference import assert_greedy_like_hf, make_tiny_hf_dir

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}

PHI3_LONGROPE = dict(original_max_position_embeddings=48, rope_parameters={
    "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(8)],
    "long_factor": [1.5 + 0.5 * i for i in range(8)], "original_max_position_embeddings": 48})

# case -> (model_type, config overrides, prompt lengths[, engine options])
CASES = {
    # Llama 3.2: tied embeddings, GQA, Llama 3.1's rope scaling
    "llama-3.2": ("llama", dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE), (3, 60)),
    "qwen3-qk-norm": ("qwen3", dict(head_dim=32, num_hidden_layers=3, use_sliding_window=True, sliding_window=8,
                                    max_window_layers=1), (10, 40)),
    # Gemma 2: sandwich norms (+1 RMSNorm), GELU-tanh, sqrt(hidden) embedding scale, tied, attention and
    # final soft caps small enough to bite, query_pre_attn_scalar != head_dim, alternating windows
    "gemma2": ("gemma2", dict(head_dim=32, num_hidden_layers=3, query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
                              final_logit_softcapping=4.0, sliding_window=8, tie_word_embeddings=True), (10, 40)),
    # Phi-3: merged qkv_proj / gate_up_proj in the checkpoint; longrope. The short factors serve an
    # engine whose contexts fit original_max_position_embeddings (48); a window shorter than the prompts.
    "phi3-longrope-short": ("phi3", dict(sliding_window=16, **PHI3_LONGROPE), (21, 25), dict(max_model_len=48)),
    # ... and the long factors every position of a longer context (transformers: once a sequence is longer)
    "phi3-longrope-long": ("phi3", PHI3_LONGROPE, (49, 70)),
    # Phi-4-mini style: partial rotary
    "phi3-partial-rotary": ("phi3", dict(hidden_size=128, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}), (3, 60)),
    # OPT: LayerNorm, ReLU fc1/fc2, biases everywhere, learned positions (offset 2), tied, no GQA
    "opt": ("opt", dict(ffn_dim=128, num_key_value_heads=None, max_position_embeddings=128), (3, 60)),
    # Persimmon: LayerNorm, squared ReLU, per-head q/k LayerNorm, half rotary, interleaved query_key_value
    "persimmon": ("persimmon", dict(hidden_size=128, num_key_value_heads=None, qk_layernorm=True,
                                    rope_parameters={"rope_type": "default", "rope_theta": 25000.0,
                                                     "partial_rotary_factor": 0.5}), (3, 60)),
    # StableLM 2: LayerNorm, a LayerNorm per head on q and k, quarter rotary, qkv bias, GQA
    "stablelm": ("stablelm", dict(hidden_size=128, qk_layernorm=True, use_qkv_bias=True, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}), (3, 60)),
    # Granite: embedding / attention / residual multipliers and logits scaling
    "granite": ("granite", dict(embedding_multiplier=6.0, attention_multiplier=0.09, residual_multiplier=0.4,
                                logits_scaling=3.0), (3, 60)),
    # Nemotron (NeVA's NVGPT decoder): LayerNorm1P (stores w - 1) with bias, squared ReLU up/down MLP,
    # half rotary, GQA
    "nemotron": ("nemotron", dict(hidden_size=128, partial_rotary_factor=0.5, head_dim=32), (3, 60)),
    # mBART's decoder (MBartForCausalLM; Nougat's, without cross-attention): LayerNorm, GELU fc1/fc2,
    # learned positions (offset 2), sqrt(d_model) embedding scale, a LayerNorm on the embeddings, tied;
    # the decoder's own layer/head counts differ from the encoder's (which num_hidden_layers names)
    "mbart": ("mbart", dict(intermediate_size=None, num_key_value_heads=None, decoder_layers=2, encoder_layers=5,
                            num_attention_heads=None, encoder_attention_heads=8, num_hidden_layers=None,
                            decoder_attention_heads=4, decoder_ffn_dim=128, scale_embedding=True,
                            max_position_embeddings=128), (3, 60)),
    # Mixtral: top-2 of 4 experts through the fused MoE layer
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2), (3, 60)),
    # Qwen2-MoE: 4 experts, top 2 unnormalised, a shared expert with a sigmoid gate, a dense layer
    "qwen2-moe": ("qwen2_moe", dict(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=64, mlp_only_layers=[1]), (3, 60)),
}


def _prompts(vocab: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(*lengths))] for _ in range(6)]


@pytest.mark.parametrize("case", list(CASES))
def test_family_greedy_parity_with_transformers(case, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM
    model_type, overrides, lengths, *engine = CASES[case]
    path = make_tiny_hf_dir(tmp_path / case, tokenizer, model_type, seed=list(CASES).index(case), **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(len(tokenizer), lengths, seed=1)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    llm = LLM(path, num_blocks=64, block_size=8, max_num_batched_tokens=96, attention_backend="torch_ref",
              **(engine[0] if engine else {}))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_greedy_like_hf(hf, prompts, outs, NEW_TOKENS)
    assert llm.engine.kv_manager.pool.is_whole()
