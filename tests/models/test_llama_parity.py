"""splitserve vs transformers on the same random weights: greedy tokens equal, logprobs close."""
import random

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.loading.resolve import load_tokenizer
from tests.hf_reference import assert_greedy_like_hf, make_tiny_llama_dir

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def random_prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 60))] for _ in range(n)]


CASES = {
    "mha-tied": dict(num_kv_heads=4, tie=True),
    "gqa-untied": dict(num_kv_heads=2, tie=False),
    "mqa-llama3-rope": dict(num_kv_heads=1, tie=False, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, rope_theta=500000.0),
    "qkv-bias-qwen2": dict(num_kv_heads=2, tie=False, arch="qwen2"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_parity_with_transformers(case, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM
    path = make_tiny_llama_dir(tmp_path / case, tokenizer, seed=list(CASES).index(case), **CASES[case])  # fixed: hash() of a str changes per process
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts(len(tokenizer), 8, seed=1)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    llm = LLM(path, num_blocks=64, max_num_batched_tokens=256)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_greedy_like_hf(hf, prompts, outs, NEW_TOKENS)
    assert llm.engine.kv_manager.pool.is_whole()
