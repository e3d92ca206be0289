"""FP8 KV cache with per-layer scales from the checkpoint, end to end: a tiny random Llama saved with
KV-cache scales under two checkpoint spellings, served with --kv-cache-dtype fp8, against transformers
on the same weights with its K and V rounded to e4m3 with the same scales (tests/hf_reference.py).
Two layers keep the comparison tight: a rounding flip at an e4m3 midpoint has few layers to grow in."""
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve import LLM, SamplingParams
from splitserve.loading.resolve import load_tokenizer
from tests.hf_reference import e4m3_kv_attention, hf_greedy, make_tiny_llama_dir

NEW_TOKENS = 24
# layer -> (k_scale, v_scale): near max |x| / 448 of these weights' K and V (0.011 to 0.014), so the
# stored values span e4m3's range and the largest saturate at 448
SCALES = {0: (0.012, 0.009), 1: (0.011, 0.0125)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tokenizer = load_tokenizer(None)
    path = make_tiny_llama_dir(tmp_path_factory.mktemp("fp8kv"), tokenizer, num_kv_heads=2, tie=False, seed=3)
    file = f"{path}/model.safetensors"
    tensors = load_file(file)
    # Layer 0 as compressed-tensors writes them, layer 1 as older compressed-tensors did (the k/v
    # projections' output scales); both as one-element tensors of the checkpoint's dtype.
    (k0, v0), (k1, v1) = SCALES[0], SCALES[1]
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(k0)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(v0)
    tensors["model.layers.1.self_attn.k_proj.output_scale"] = torch.tensor([k1])
    tensors["model.layers.1.self_attn.v_proj.output_scale"] = torch.tensor([v1])
    save_file(tensors, file, metadata={"format": "pt"})
    rng = random.Random(2)
    prompts = [[rng.randrange(3, len(tokenizer)) for _ in range(rng.randrange(3, 60))] for _ in range(6)]
    return path, prompts


def _hf(path, attn_implementation):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # ignores the scale tensors
    model.set_attn_implementation(attn_implementation)
    return model


def _run(path, prompts, **kwargs):
    llm = LLM(path, num_blocks=64, max_num_batched_tokens=256, **kwargs)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.kv_manager.pool.is_whole()
    return llm, [(o.outputs[0].token_ids, [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                 for o in outs]


def test_fp8_cache_with_checkpoint_scales_matches_transformers(checkpoint):
    path, prompts = checkpoint
    llm, got = _run(path, prompts, kv_cache_dtype="fp8")
    layers = llm.engine.runner.model.layers
    loaded = [s.item() for layer in layers for s in (layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale)]
    assert loaded == pytest.approx([*SCALES[0], *SCALES[1]], rel=1e-7)
    hf = _hf(path, e4m3_kv_attention(SCALES))
    hf_unscaled = _hf(path, e4m3_kv_attention())  # the control: scales of 1.0 give other logprobs
    far = 0
    for prompt, (tokens, logprobs) in zip(prompts, got):
        ref_tokens, ref_logprobs = hf_greedy(hf, prompt, NEW_TOKENS)
        assert tokens == ref_tokens
        assert logprobs == pytest.approx(ref_logprobs, abs=1e-3)
        _, unscaled = hf_greedy(hf_unscaled, prompt, NEW_TOKENS)
        far += logprobs != pytest.approx(unscaled, abs=1e-3)
    assert far >= len(prompts) // 2


def test_model_dtype_cache_ignores_checkpoint_scales(checkpoint):
    path, prompts = checkpoint
    _, got = _run(path, prompts[:3])
    hf = _hf(path, "sdpa")
    for prompt, (tokens, logprobs) in zip(prompts, got):
        ref_tokens, ref_logprobs = hf_greedy(hf, prompt, NEW_TOKENS)
        assert tokens == ref_tokens
        assert logprobs == pytest.approx(ref_logprobs, abs=2e-4)
