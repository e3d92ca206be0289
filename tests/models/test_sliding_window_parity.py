"""Sliding-window models vs transformers on the same random weights, prompts longer than the window:
greedy tokens equal, logprobs close. Mistral (every layer windowed: the KV manager frees passed blocks,
and a small pool hands them to other requests while stale ids stay in the freeing request's table)
and Qwen2 with use_sliding_window from layer 1 on (local and global layers in one step: nothing freed)."""
import random

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.loading.resolve import load_tokenizer
from tests.hf_reference import assert_greedy_like_hf, make_tiny_llama_dir

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


CASES = {
    "mistral-window-7": (dict(arch="mistral", num_kv_heads=2, tie=False, sliding_window=7), 7),
    "qwen2-local-and-global": (dict(arch="qwen2", num_kv_heads=2, tie=False, use_sliding_window=True,
                                    sliding_window=6, max_window_layers=1), None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sliding_window_greedy_parity_with_transformers(case, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM
    overrides, free_window = CASES[case]
    path = make_tiny_llama_dir(tmp_path / case, tokenizer, seed=3 + list(CASES).index(case), **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(5)
    prompts = [[rng.randrange(3, len(tokenizer)) for _ in range(rng.randrange(9, 40))] for _ in range(6)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    llm = LLM(path, num_blocks=20, block_size=8, max_num_batched_tokens=64)
    assert llm.engine.kv_manager.sliding_window == free_window
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_greedy_like_hf(hf, prompts, outs, NEW_TOKENS)
    assert llm.engine.kv_manager.pool.is_whole()


def test_window_matters_in_the_reference():
    """The window must change transformers' own output for these prompts (else parity proves nothing)."""
    from transformers import MistralConfig, MistralForCausalLM
    kw = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, initializer_range=0.2)
    torch.manual_seed(0)
    windowed = MistralForCausalLM(MistralConfig(sliding_window=7, **kw)).eval()
    full = MistralForCausalLM(MistralConfig(sliding_window=None, **kw)).eval()
    full.load_state_dict(windowed.state_dict())
    ids = torch.randint(3, 100, (1, 30))
    with torch.inference_mode():
        assert not torch.allclose(windowed(ids).logits[0, -1], full(ids).logits[0, -1], atol=1e-3)
