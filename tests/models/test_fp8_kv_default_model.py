"""FP8 KV cache (--kv-cache-dtype fp8) on the real default model (SmolLM2-135M-Instruct GGUF, no KV
scales in the file, so 1.0), CPU, greedy, 64 tokens.

Two references:
- transformers on the same file with its K and V rounded to e4m3 (after the rotary, as the cache
  stores them) before attention: the same maths done independently, so tokens and logprobs agree;
- the engine's own model-dtype cache, which FP8 perturbs (see test_fp8_against_the_model_dtype_cache).
"""
import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.models.resolve import default_model_source
from tests.hf_reference import hf_greedy

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a CPU does.",
]
NEW_TOKENS = 64
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def prompts_and_runs():
    """Prompt token ids, and the outputs of the model-dtype (fp32 on CPU) cache and the FP8 cache."""
    ref_llm = LLM(cpu_kv_cache_gib=0.25)
    prompts = [ref_llm.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]  # token ids
    ref = ref_llm.generate(prompts, PARAMS, use_tqdm=False)
    ref_blocks = ref_llm.engine.core.num_blocks
    del ref_llm
    fp8_llm = LLM(cpu_kv_cache_gib=0.25, kv_cache_dtype="fp8")
    fp8 = fp8_llm.generate(prompts, PARAMS, use_tqdm=False)
    runner = fp8_llm.engine.core.runner
    assert all(c.dtype == torch.float8_e4m3fn for c in runner.kv_caches)
    # fp32 model: 4 bytes an element against 1, so the same 0.25 GiB holds 4x the blocks (2x against bf16)
    assert fp8_llm.engine.core.num_blocks in range(4 * ref_blocks, 4 * ref_blocks + 4)
    assert fp8_llm.engine.kv_manager.pool.is_whole()
    return prompts, ref, fp8


def _fake_quantized_kv_attention():
    """transformers' SDPA attention with K and V rounded to e4m3 (scale 1.0, saturating at 448)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def e4m3(x):
        return x.float().clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype)

    def attention(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, e4m3(key), e4m3(value), attention_mask, **kwargs)

    AttentionInterface.register("splitserve_fp8_kv", attention)
    return "splitserve_fp8_kv"


@pytest.fixture(scope="module")
def hf_fp8_kv_model():
    from transformers import AutoModelForCausalLM
    src = default_model_source()
    model = AutoModelForCausalLM.from_pretrained(src.directory, gguf_file=src.gguf_file, dtype=torch.float32).eval()
    model.set_attn_implementation(_fake_quantized_kv_attention())
    return model


def test_fp8_cache_matches_transformers_with_e4m3_kv(prompts_and_runs, hf_fp8_kv_model):
    prompts, _, fp8 = prompts_and_runs
    for prompt, out in zip(prompts, fp8):
        ref_tokens, ref_logprobs = hf_greedy(hf_fp8_kv_model, prompt, NEW_TOKENS)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens
        assert [lp[t] for lp, t in zip(got.logprobs, got.token_ids)] == pytest.approx(ref_logprobs, abs=2e-3)


def test_fp8_against_the_model_dtype_cache(prompts_and_runs):
    """Greedy parity with the model-dtype cache: tokens equal, or the first divergence explained by
    a near tie in the reference (its top-2 logprobs less than MARGIN apart), the FP8 run taking the
    reference's runner-up."""
    _, ref, fp8 = prompts_and_runs
    report = []
    for a, b in zip(ref, fp8):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        d = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        if d is None:
            report.append("equal")
            continue
        top = sorted(a.outputs[0].logprobs[d].items(), key=lambda kv: -kv[1])
        margin = top[0][1] - top[1][1]
        report.append(f"first divergence at {d}: reference top-2 margin {margin:.3f}, FP8 took "
                      f"{'the runner-up' if tb[d] == top[1][0] else 'another token'}")
        assert tb[d] == top[1][0], report
        assert margin < MARGIN, report
    print(report)


MARGIN = 0.05
