"""Prefill sharing end to end (core/scheduler.py `_reserve`): with a small step budget a long prompt is
chunked while short prompts run beside its chunks and decodes go on behind it; every request's greedy
tokens equal Hugging Face transformers' on the same weights, one prompt at a time."""
from __future__ import annotations

import pytest
import torch

from splitserve.core.scheduler import Scheduler
from splitserve.engine.llm import LLM
from splitserve.loading.resolve import load_tokenizer
from splitserve.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy, make_tiny_llama_dir

pytestmark = pytest.mark.slow

NEW_TOKENS = 6
PROMPTS = [[1] + [(37 * k) % 4000 + 10 for k in range(150)],  # 150 tokens: 5 chunks of a 32 budget alone
           [1, 422, 2301, 8830], [1, 504, 3575, 282, 4649, 314], [1, 77, 88, 99, 1000, 2000]]


def test_chunked_long_prompt_and_short_ones_match_transformers(tmp_path, monkeypatch):
    reserved = []
    original = Scheduler._reserve

    def spy(self, budget):
        reserved.append(original(self, budget))
        return reserved[-1]
    monkeypatch.setattr(Scheduler, "_reserve", spy)
    path = make_tiny_llama_dir(tmp_path, load_tokenizer(None), num_kv_heads=2, tie=False, seed=7)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    expected = [hf_greedy(model, p, NEW_TOKENS)[0] for p in PROMPTS]
    llm = LLM(path, max_model_len=256, max_num_batched_tokens=32, max_num_seqs=8, cpu_kv_cache_gib=0.05)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert max(reserved) == 4 + 6 + 6  # the three short prompts ran beside the long one's second chunk
