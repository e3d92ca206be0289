"""Scheduling must not change results: chunked prefill, preemption and prefix-cache hits give exactly
the greedy tokens of an unconstrained run, and every KV block is back in the pool afterwards."""
import random

import pytest

from splitserve import LLM, SamplingParams
from splitserve.loading.resolve import load_tokenizer
from tests.hf_reference import make_tiny_llama_dir

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny"), load_tokenizer(None), num_kv_heads=2, tie=False, seed=7)


def prompts_with_shared_prefixes(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 40000) for _ in range(40)]  # 2.5 blocks shared by half the prompts
    out = []
    for i in range(10):
        tail = [rng.randrange(3, 40000) for _ in range(rng.randrange(1, 30))]
        out.append(system + tail if i % 2 else tail + system[:rng.randrange(0, 20)])
    return out


def run(model_dir, prompts, **engine_kwargs):
    llm = LLM(model_dir, **engine_kwargs)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm.engine, [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def baseline(model_dir):
    # One prompt at a time, no prefix caching, ample blocks: nothing interacts.
    llm = LLM(model_dir, num_blocks=256, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    return [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts_with_shared_prefixes()]


def test_tiny_token_budget_forces_chunked_prefill(model_dir, baseline):
    engine, tokens = run(model_dir, prompts_with_shared_prefixes(), num_blocks=256, max_num_batched_tokens=7,
                         enable_prefix_caching=False)
    assert tokens == baseline
    assert engine.kv_manager.pool.is_whole()


def test_too_few_blocks_forces_preemption(model_dir, baseline):
    # 10 requests of up to ~94 tokens each need ~60 blocks together; 14 blocks hold few at a time.
    engine, tokens = run(model_dir, prompts_with_shared_prefixes(), num_blocks=14, block_size=8,
                         enable_prefix_caching=False)
    assert engine.scheduler.num_preemptions > 0
    assert tokens == baseline
    assert engine.kv_manager.pool.is_whole()


def test_shared_prefixes_hit_the_prefix_cache(model_dir, baseline):
    engine, tokens = run(model_dir, prompts_with_shared_prefixes(), num_blocks=256, max_num_seqs=2)
    assert engine.kv_manager.prefix_hits > 0
    assert tokens == baseline
    assert engine.kv_manager.pool.is_whole()
    # A second pass over the same prompts reuses their cached blocks and still agrees.
    hits_before = engine.kv_manager.prefix_hits
    llm_tokens = [o.outputs[0].token_ids for o in engine_generate(engine, prompts_with_shared_prefixes())]
    assert engine.kv_manager.prefix_hits - hits_before >= 10 * 16
    assert llm_tokens == baseline
    assert engine.kv_manager.pool.is_whole()


def test_everything_at_once(model_dir, baseline):
    engine, tokens = run(model_dir, prompts_with_shared_prefixes(), num_blocks=20, block_size=8,
                         max_num_batched_tokens=13, max_num_seqs=5)
    assert tokens == baseline
    assert engine.kv_manager.pool.is_whole()


def engine_generate(engine, prompts):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def test_piecewise_segments_give_the_same_tokens(model_dir, baseline):
    # The piecewise-graph path, run without graphs on CPU: the same segments, static buffers and
    # padding to token buckets as on the GPU. Buckets 8/32 pad decode and chunk steps; steps of more
    # than 32 tokens take the plain path, so both alternate within one run.
    from splitserve.worker.cuda_graphs import PiecewiseGraphs
    llm = LLM(model_dir, num_blocks=256, max_num_batched_tokens=40, enable_prefix_caching=False)
    runner = llm.engine.runner
    runner.piecewise = PiecewiseGraphs(runner.model, [8, 32], runner.device, use_graphs=False)
    calls = []
    run_segments = runner.piecewise.run
    runner.piecewise.run = lambda *a: calls.append(a[0].shape[0]) or run_segments(*a)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts_with_shared_prefixes(), params, use_tqdm=False)]
    assert tokens == baseline
    assert any(n < 8 for n in calls) and any(8 < n < 32 for n in calls)  # padded in both buckets
    assert llm.engine.kv_manager.pool.is_whole()


def test_decode_graph_path_gives_the_same_tokens(model_dir, baseline):
    # The full decode-graph path, run without graphs on CPU: the backend's static metadata buffers,
    # its capture-time metadata (lengths only on the device, max_seq_len at the model's limit) and
    # its refill before each "replay", padding steps up to the graph sizes.
    from splitserve.worker.cuda_graphs import DecodeGraphs
    llm = LLM(model_dir, num_blocks=256, enable_prefix_caching=False, max_num_seqs=3)
    runner = llm.engine.runner
    m = runner.config.model
    runner.graphs = DecodeGraphs(runner.model, runner.backend, [2, 4, 16], runner.max_blocks_per_seq,
                                 m.max_model_len, m.num_kv_heads, runner.device, use_graphs=False)
    calls = []
    run_graph = runner.graphs.run
    runner.graphs.run = lambda num_seqs, *a: calls.append(num_seqs) or run_graph(num_seqs, *a)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts_with_shared_prefixes(), params, use_tqdm=False)]
    assert tokens == baseline
    assert {1, 3} <= set(calls)  # steps padded to 2 and to 4
    assert llm.engine.kv_manager.pool.is_whole()


@pytest.mark.parametrize("engine_kwargs", [
    dict(num_blocks=256),                                                    # decode steps overlap
    dict(num_blocks=20, block_size=8, max_num_batched_tokens=13, max_num_seqs=5),  # + chunks, preemption
], ids=["plain", "constrained"])
def test_async_scheduling_gives_the_same_tokens(model_dir, baseline, engine_kwargs):
    # Each step is scheduled and launched before the previous step's tokens are read on the host.
    engine, tokens = run(model_dir, prompts_with_shared_prefixes(), async_scheduling=True, **engine_kwargs)
    assert tokens == baseline
    assert engine.kv_manager.pool.is_whole() and engine.core._inflight is None
    # A second pass hits the prefix cache; blocks registered under async scheduling are sound.
    assert [o.outputs[0].token_ids for o in engine_generate(engine, prompts_with_shared_prefixes())] == baseline
    assert engine.kv_manager.pool.is_whole()


def test_async_scheduling_with_stops_penalties_and_seeds(model_dir):
    # EOS/stop tokens discovered one step late, penalties (which force a sync step) and seeded
    # sampling: the same outputs as stepping synchronously.
    prompts = prompts_with_shared_prefixes(seed=9)
    probe = LLM(model_dir, num_blocks=256).generate(
        prompts[:1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    stop_token = probe[0].outputs[0].token_ids[5]
    params = [SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[stop_token]),
              SamplingParams(max_tokens=16, temperature=0, repetition_penalty=1.3, frequency_penalty=0.5),
              SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=5),
              SamplingParams(max_tokens=16, temperature=0, min_tokens=4, logprobs=2)]
    params = [params[i % len(params)] for i in range(len(prompts))]
    results = []
    for async_scheduling in (False, True):
        llm = LLM(model_dir, num_blocks=256, async_scheduling=async_scheduling)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs])
        assert llm.engine.kv_manager.pool.is_whole()
    assert results[0] == results[1]
    assert results[0][0][1] == "stop" and len(results[0][0][0]) == 6


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_request_that_ends_in_its_first_step_leaves_its_prompt_cached(model_dir, async_scheduling):
    # max_tokens=1: the prompt's step is the request's last. Its full blocks must still enter the
    # prefix cache, so the same prompt again finds them.
    llm = LLM(model_dir, num_blocks=64, async_scheduling=async_scheduling)
    prompt = prompts_with_shared_prefixes()[1]
    params = SamplingParams(max_tokens=1, temperature=0)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    second = llm.generate([prompt], params, use_tqdm=False)[0]
    assert len(prompt) > 32 and first.num_cached_tokens == 0
    assert second.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    assert llm.engine.kv_manager.prefix_hits == second.num_cached_tokens
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.engine.kv_manager.pool.is_whole() and llm.engine.runner.input_batch.num_reqs == 0
