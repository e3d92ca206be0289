"""Independent references from Hugging Face transformers: tiny random checkpoints and greedy runs."""
from __future__ import annotations

import torch


def make_tiny_llama_dir(path, tokenizer, *, num_kv_heads: int, tie: bool, seed: int = 0,
                        arch: str = "llama", **overrides) -> str:
    """Saves a random tiny Llama-family checkpoint + the given tokenizer into path; returns path."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    kw = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=num_kv_heads, max_position_embeddings=512,
              tie_word_embeddings=tie, initializer_range=0.2, rms_norm_eps=1e-6,
              bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    kw.update(overrides)
    torch.manual_seed(seed)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kw))
    elif arch == "mistral":
        from transformers import MistralConfig, MistralForCausalLM
        model = MistralForCausalLM(MistralConfig(**kw))
    else:
        model = LlamaForCausalLM(LlamaConfig(**kw))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def make_tiny_hf_dir(path, tokenizer, model_type: str, *, seed: int = 0, **overrides) -> str:
    """Saves a random tiny checkpoint of any transformers causal-LM family (by model_type) + the given
    tokenizer into path; returns path. Small shapes with GQA, 2 layers, large random weights, norms and
    biases perturbed (so the greedy tokens depend on every part of the model) unless overrides say otherwise."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM
    kw = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              initializer_range=0.2, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
              pad_token_id=None)
    kw.update(overrides)
    kw = {k: v for k, v in kw.items() if v is not None or k == "pad_token_id"}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type](**kw), dtype=torch.float32)
    with torch.no_grad():  # norms and biases start as ones / zeros: make them matter too
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probabilities, one prompt at a time (no padding effects)."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                         eos_token_id=None, forced_eos_token_id=None)  # (mBART's config forces EOS last)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
    return tokens, logprobs



def assert_greedy_like_hf(hf_model, prompts: list[list[int]], outs, max_new_tokens: int, atol: float = 2e-4) -> None:
    """Each engine output (RequestOutput with logprobs=0) has transformers' greedy tokens for its
    prompt, and their log-probabilities within atol."""
    import pytest
    for prompt, out in zip(prompts, outs, strict=True):
        ref_tokens, ref_logprobs = hf_greedy(hf_model, prompt, max_new_tokens)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens
        got_logprobs = [lp[t] for lp, t in zip(got.logprobs, got.token_ids)]
        assert got_logprobs == pytest.approx(ref_logprobs, abs=atol)

def e4m3_kv_attention(scales: dict[int, tuple[float, float]] | None = None) -> str:
    """Registers (and names) a transformers attention function that is SDPA over K and V rounded to
    FP8 e4m3 the way an FP8 KV cache stores them: per layer, x / scale in fp32, saturated at +-448,
    rounded to e4m3 by torch's cast, times the scale; `scales` maps a layer index to its (k_scale,
    v_scale), 1.0 where absent. Use it with model.set_attn_implementation(name)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    scales = dict(scales or {})

    def e4m3(x, scale):
        s = torch.tensor(scale, dtype=torch.float32)
        return ((x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).to(x.dtype)

    def attention(module, query, key, value, attention_mask, **kwargs):
        k_scale, v_scale = scales.get(module.layer_idx, (1.0, 1.0))
        return sdpa_attention_forward(module, query, e4m3(key, k_scale), e4m3(value, v_scale), attention_mask,
                                      **kwargs)

    name = f"splitserve_e4m3_kv_{len(_E4M3_NAMES)}"
    _E4M3_NAMES.append(name)
    AttentionInterface.register(name, attention)
    return name


_E4M3_NAMES: list[str] = []
