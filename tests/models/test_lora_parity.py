"""Multi-LoRA vs PEFT: adapters made by peft (random non-zero A and B), the reference is transformers
with each adapter merged into the base weights (peft's merge_and_unload), one prompt at a time.

One batch mixes four adapters of ranks 8, 16, 32 and 64 (with different alpha, one rsLoRA, one on a
subset of the projections) and base-model requests; each request must get its own adapter's greedy
tokens. Then the same with fewer slots than adapters (eviction under pressure), and the prefix cache
keyed by adapter."""
import random

import pytest
import torch

from splitserve import LLM, LoRARequest, SamplingParams
from splitserve.loading.resolve import default_model_source, load_tokenizer
from tests.hf_reference import hf_greedy, make_tiny_llama_dir
from tests.lora_reference import make_peft_adapter, merged_reference

# (rank, alpha, extra LoraConfig options)
ADAPTERS = [(8, 16, {}), (16, 8, {"use_rslora": True}), (32, 64, {"targets": ["q_proj", "v_proj", "down_proj"]}),
            (64, 32, {})]
NEW_TOKENS = 12


def build_case(hf, tmp_path, seed0: int, magnitude: float):
    loras, refs = [], []
    for i, (rank, alpha, extra) in enumerate(ADAPTERS):
        path = make_peft_adapter(hf, tmp_path / f"adapter{i}", rank=rank, alpha=alpha, seed=seed0 + i,
                                 magnitude=magnitude, **extra)
        loras.append(LoRARequest(f"adapter{i}", i + 1, path))
        refs.append(merged_reference(hf, path))
    return loras, refs


def check_mixed_batch(llm, hf, loras, refs, prompts):
    # adapters 0..3, base, then the adapters again in another order, another base
    plan = [0, 1, 2, 3, None, 3, 1, None, 2, 0]
    prompts = [prompts[i % len(prompts)] for i in range(len(plan))]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False,
                        lora_request=[None if k is None else loras[k] for k in plan])
    base_tokens, changes = {}, set()
    for k, prompt, out in zip(plan, prompts, outs):
        model = hf if k is None else refs[k]
        ref, _ = hf_greedy(model, prompt, NEW_TOKENS)
        assert out.outputs[0].token_ids == ref, f"adapter {k}"
        if k is not None:
            base_tokens.setdefault(tuple(prompt), hf_greedy(hf, prompt, NEW_TOKENS)[0])
            if ref != base_tokens[tuple(prompt)]:
                changes.add(k)
    # each adapter changes some output: a delta that got lost would be seen
    assert changes == {k for k in plan if k is not None}
    assert llm.engine.kv_manager.pool.is_whole()
    return outs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    tmp = tmp_path_factory.mktemp("tiny_lora")
    tok = load_tokenizer(None)
    path = make_tiny_llama_dir(tmp / "base", tok, num_kv_heads=2, tie=False, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    loras, refs = build_case(hf, tmp, 100, 0.1)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, len(tok)) for _ in range(rng.randrange(3, 50))] for _ in range(5)]
    return path, hf, loras, refs, prompts


def test_tiny_llama_mixed_adapters_match_peft(tiny):
    path, hf, loras, refs, prompts = tiny
    llm = LLM(path, num_blocks=128, max_num_batched_tokens=96, enable_lora=True, max_loras=4, max_lora_rank=64)
    check_mixed_batch(llm, hf, loras, refs, prompts)
    assert llm.engine.core.lora.num_slot_loads == 4


def test_tiny_llama_fewer_slots_than_adapters_same_outputs(tiny):
    """Two slots, four adapters in one batch: requests wait for a slot, slots are evicted and reloaded,
    and host memory holds only two adapters (the rest are read from disk again)."""
    path, hf, loras, refs, prompts = tiny
    llm = LLM(path, num_blocks=128, max_num_batched_tokens=96, enable_lora=True, max_loras=2, max_lora_rank=64,
              max_cpu_loras=2, max_num_seqs=3)
    manager = llm.engine.core.lora
    check_mixed_batch(llm, hf, loras, refs, prompts)
    first = manager.num_slot_loads
    assert first >= 4  # four adapters through two slots: evictions
    check_mixed_batch(llm, hf, loras, refs, prompts)  # the two not in a slot are loaded again
    assert manager.num_slot_loads >= first + 2
    assert len(manager._host) <= 2 and all(n == 0 for n in manager.pins.values())


def test_graph_paths_with_adapters_match_peft(tiny):
    """The decode-graph and piecewise-graph paths, run without graphs on CPU: the static input
    buffers, batches padded to the graph sizes (the padding rows have no adapter in the step layout),
    and the LoRA variant of the decode graphs picked for steps with adapters only."""
    from splitserve.worker.cuda_graphs import DecodeGraphs, PiecewiseGraphs
    path, hf, loras, refs, prompts = tiny
    llm = LLM(path, num_blocks=128, max_num_batched_tokens=96, enable_lora=True, max_loras=4, max_lora_rank=64,
              max_num_seqs=12)
    runner = llm.engine.runner
    state, m = runner.lora.model.state, runner.config.model
    runner.graphs = DecodeGraphs(runner.model, runner.backend, [4, 16], runner.max_blocks_per_seq, m.max_model_len,
                                 m.num_kv_heads, runner.device, use_graphs=False, lora_state=state)
    # Buckets up to the step budget (96): every step that is not a pure decode takes the piecewise
    # path, whatever the adapter loader's timing makes of the steps (on a loaded machine the adapter
    # requests can all become ready at once, in steps above 64 tokens).
    runner.piecewise = PiecewiseGraphs(runner.model, [16, 64, 128], runner.device, use_graphs=False,
                                       lora_state=state)
    decode_calls, piecewise_calls = [], []
    run_decode, run_piecewise = runner.graphs.run, runner.piecewise.run
    runner.graphs.run = lambda n, *a: decode_calls.append((n, a[-1])) or run_decode(n, *a)  # a[-1]: lora
    runner.piecewise.run = lambda ids, *a: piecewise_calls.append(ids.shape[0]) or run_piecewise(ids, *a)
    check_mixed_batch(llm, hf, loras, refs, prompts)
    assert any(lora and n not in (4, 16) for n, lora in decode_calls)  # padded decode steps with adapters
    assert any(n not in (16, 64, 128) for n in piecewise_calls), piecewise_calls  # padded to a bucket
    decode_calls.clear()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts[:3], params, use_tqdm=False)  # base model only: the plain decode graphs
    assert decode_calls and not any(lora for _, lora in decode_calls)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 4)[0] for p in prompts[:3]]


def test_prefix_cache_is_keyed_by_adapter(tiny):
    path, hf, loras, refs, prompts = tiny
    llm = LLM(path, num_blocks=128, max_num_batched_tokens=256, enable_lora=True, max_loras=2, max_lora_rank=64,
              block_size=16)
    prompt = list(range(10, 10 + 70))  # four full blocks
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    def run(lora):
        out = llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0]
        return out.num_cached_tokens, out.outputs[0].token_ids

    assert run(loras[0])[0] == 0
    cached, tokens_b = run(loras[1])
    assert cached == 0, "a second adapter must not reuse the first one's KV blocks"
    assert tokens_b == hf_greedy(refs[1], prompt, 4)[0]
    assert run(loras[0])[0] == 64, "the same adapter reuses its own blocks"
    assert run(None)[0] == 0, "the base model shares no blocks with an adapter"
    assert run(None)[0] == 64
    assert llm.engine.kv_manager.pool.is_whole()


def test_default_model_mixed_adapters_match_peft(tmp_path):
    from transformers import AutoModelForCausalLM
    src = default_model_source()
    hf = AutoModelForCausalLM.from_pretrained(src.directory, gguf_file=src.gguf_file, dtype=torch.float32).eval()
    loras, refs = build_case(hf, tmp_path, 200, 0.1)
    llm = LLM(enable_lora=True, max_loras=4, max_lora_rank=64, num_blocks=256, max_num_batched_tokens=128)
    chats = ["What is the capital of France?", "Name a color.", "Count to five."]
    prompts = [llm.apply_chat_template([{"role": "user", "content": c}]) for c in chats]
    check_mixed_batch(llm, hf, loras, refs, prompts)
