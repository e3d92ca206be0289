"""GGUF files of the families llama.cpp writes (llama, qwen2, qwen3, gemma2, phi3) load through the
same weight maps as their safetensors checkpoints: each file is written here, the way llama.cpp's
converter writes it (its tensor names from the gguf package's own map, Llama's Q/K permutation,
Gemma's norm offset folded in, Phi-3's merged projections and rope factor tensors, Llama 3.1's
rope_freqs), from the random weights of a transformers model, and the engine's greedy tokens and
logprobs on the file are compared with that model's."""
import math
import random

import numpy as np
import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.loading.resolve import load_tokenizer
from tests.hf_reference import assert_greedy_like_hf, make_tiny_hf_dir

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: each head's rotary halves interleaved row by row."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_freqs(cfg) -> np.ndarray:
    """llama.cpp's rope_freqs tensor for Llama 3.1 scaling: the divisor of each default frequency."""
    p = cfg.rope_parameters
    dim = cfg.head_dim
    freqs = 1.0 / (p["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high, old = p["factor"], p["low_freq_factor"], p["high_freq_factor"], p["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(hf_model, path: str, arch: str) -> None:
    import gguf
    cfg = hf_model.config
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    rope = cfg.rope_parameters
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if arch == "gemma2":
        w.add_sliding_window(cfg.sliding_window)
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "phi3":
        if cfg.sliding_window:
            w.add_sliding_window(cfg.sliding_window)
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        if rope["rope_type"] == "longrope":
            scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(cfg.original_max_position_embeddings)))
            w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    if arch == "llama" and rope["rope_type"] == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_freqs(cfg))
    for name, tensor in hf_model.state_dict().items():
        if "rotary_emb" in name or (cfg.tie_word_embeddings and name == "lm_head.weight"):
            continue
        data = tensor.float().numpy().copy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            data = _llama_cpp_permute(data, n_head)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            data = _llama_cpp_permute(data, n_kv)
        elif arch == "gemma2" and name.endswith("norm.weight"):
            data = data + 1.0  # llama.cpp folds Gemma's (1 + w) into the stored weight
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        w.add_tensor(gguf_name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}

# arch -> (transformers model_type, config overrides, prompt lengths, engine options)
CASES = {
    "llama": ("llama", dict(rope_parameters=LLAMA3_ROPE), (3, 50), {}),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True), (3, 50), {}),
    "qwen3": ("qwen3", dict(head_dim=32), (3, 50), {}),
    "gemma2": ("gemma2", dict(head_dim=32, query_pre_attn_scalar=32, attn_logit_softcapping=3.0,
                              final_logit_softcapping=4.0, sliding_window=8), (10, 40), {}),
    "phi3": ("phi3", dict(original_max_position_embeddings=48, sliding_window=16, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "short_factor": [1.0 + 0.1 * i for i in range(4)], "long_factor": [1.5 + 0.5 * i for i in range(4)],
        "original_max_position_embeddings": 48}), (20, 30), dict(max_model_len=48)),
}


@pytest.mark.parametrize("arch", list(CASES))
def test_gguf_greedy_parity_with_transformers(arch, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM
    model_type, overrides, lengths, engine = CASES[arch]
    hf_dir = make_tiny_hf_dir(tmp_path / "hf", tokenizer, model_type, seed=10 + list(CASES).index(arch), **overrides)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    path = str(tmp_path / f"{arch}.gguf")
    write_gguf(hf, path, arch)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, len(tokenizer)) for _ in range(rng.randrange(*lengths))] for _ in range(4)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    llm = LLM(path, tokenizer=hf_dir, num_blocks=48, block_size=8, max_num_batched_tokens=96,
              attention_backend="torch_ref", **engine)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_greedy_like_hf(hf, prompts, outs, NEW_TOKENS, atol=5e-4)
