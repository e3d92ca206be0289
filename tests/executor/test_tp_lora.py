"""LoRA with several ranks (worker processes over gloo on CPU): the adapters reach every rank in the step
message's slot loads, each rank cuts its part (column-parallel: B's rows; row-parallel: A's columns, the
delta summed by the layer's all-reduce) and a pipeline stage takes its layers only. The greedy tokens
equal the engine's at TP=1 and peft's (each adapter merged into the transformers model, lora_reference).

One slot for two adapters: the second request's adapter evicts the first, so a slot is loaded from a
later message over one already written, on every rank."""
from __future__ import annotations

import random

import pytest
import torch

from splitserve import LLM, LoRARequest, SamplingParams
from splitserve.loading.resolve import load_tokenizer
from tests.hf_reference import hf_greedy, make_tiny_llama_dir
from tests.lora_reference import make_peft_adapter, merged_reference

SMALL = dict(max_model_len=256, cpu_kv_cache_gib=0.05, max_num_seqs=4, max_num_batched_tokens=64,
             enable_lora=True, max_loras=1, max_lora_rank=16)
NEW_TOKENS = 8
# adapter index per request (None: the base model); two adapters through one slot
PLAN = [0, None, 1, 0]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    tmp = tmp_path_factory.mktemp("tp_lora")
    tok = load_tokenizer(None)
    # 8 query / 2 KV heads and biases on o_proj and down_proj (row-parallel: added once, after the
    # sum the LoRA delta joins): every projection's cut is exercised at TP=2.
    path = make_tiny_llama_dir(tmp / "base", tok, num_kv_heads=2, tie=False, num_attention_heads=8, seed=5,
                               num_hidden_layers=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    loras, refs = [], []
    for i, (rank, alpha, targets) in enumerate([(8, 16, None), (16, 8, ["k_proj", "o_proj", "up_proj", "down_proj"])]):
        adapter = make_peft_adapter(hf, tmp / f"adapter{i}", rank=rank, alpha=alpha, seed=40 + i, magnitude=0.1,
                                    targets=targets)
        loras.append(LoRARequest(f"adapter{i}", i + 1, adapter))
        refs.append(merged_reference(hf, adapter))
    rng = random.Random(3)
    prompts = [[rng.randrange(3, len(tok)) for _ in range(rng.randrange(4, 30))] for _ in PLAN]
    want = [hf_greedy(hf if k is None else refs[k], p, NEW_TOKENS)[0] for k, p in zip(PLAN, prompts)]
    base = [hf_greedy(hf, p, NEW_TOKENS)[0] for p in prompts]
    # each adapter changes its requests' tokens: a delta lost (or added twice) on some rank is seen
    assert all(w != b for k, w, b in zip(PLAN, want, base) if k is not None)
    return path, loras, prompts, want


def generate(llm: LLM, loras, prompts) -> list[list[int]]:
    """The requests of PLAN in three calls, each adapter's after the other's ended: adapter 0, then 1
    evicting it, then 0 again over 1 (three slot loads)."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    tokens = []
    for part in (slice(0, 2), slice(2, 3), slice(3, 4)):
        outs = llm.generate(prompts[part], params, use_tqdm=False,
                            lora_request=[None if k is None else loras[k] for k in PLAN[part]])
        tokens += [list(o.outputs[0].token_ids) for o in outs]
    return tokens


@pytest.fixture(scope="module")
def tp1_tokens(case):
    path, loras, prompts, want = case
    llm = LLM(path, **SMALL)
    tokens = generate(llm, loras, prompts)
    assert llm.engine.core.lora.num_slot_loads == 3  # 0, 1, 0 again through one slot
    llm.engine.core.shutdown()
    return tokens


# the pipeline case in the slow tier: each case starts its rank processes (~18 s on two cores)
@pytest.mark.parametrize("tp,pp", [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow)])
def test_adapters_with_ranks_match_tp1_and_peft(case, tp1_tokens, tp, pp):
    path, loras, prompts, want = case
    assert tp1_tokens == want
    llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **SMALL)
    try:
        manager = llm.engine.core.lora
        assert generate(llm, loras, prompts) == want
        assert manager.num_slot_loads == 3
        # every request gone: no slot held, every KV block back
        assert all(n == 0 for n in manager.pins.values())
        assert llm.engine.kv_manager.pool.is_whole()
    finally:
        llm.engine.core.shutdown()
