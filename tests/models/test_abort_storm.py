"""Hundreds of requests under a tight KV pool, a random subset aborted at random moments (waiting,
mid-prefill, mid-decode): survivors get exactly their unconstrained greedy tokens, nothing leaks."""
import random

import pytest

from splitserve import LLM, SamplingParams
from splitserve.loading.resolve import load_tokenizer
from tests.hf_reference import make_tiny_llama_dir

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny"), load_tokenizer(None), num_kv_heads=2, tie=True, seed=11)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_abort_storm_under_preemption(model_dir, async_scheduling):
    rng = random.Random(42)
    prompts = [[rng.randrange(3, 40000) for _ in range(rng.randrange(2, 50))] for _ in range(300)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)

    ref_llm = LLM(model_dir, num_blocks=512, enable_prefix_caching=False)
    reference = [o.outputs[0].token_ids for o in ref_llm.generate(prompts, params, use_tqdm=False)]

    llm = LLM(model_dir, num_blocks=48, block_size=8, max_num_batched_tokens=64, max_num_seqs=32,
              async_scheduling=async_scheduling)
    engine = llm.engine
    ids = [engine.add_request(f"r{i}", p, params, stream=False) for i, p in enumerate(prompts)]
    doomed = set(rng.sample(ids, 120))
    finished, aborted = {}, set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.finished
            finished[out.request_id] = out
        # Abort a few doomed requests wherever they are now: waiting, mid-prefill or decoding.
        live = [i for i in doomed if i in engine.states]
        for rid in rng.sample(live, min(len(live), rng.randrange(0, 4))):
            out = engine.abort_request(rid)[0]
            assert out.finished and out.outputs[0].finish_reason == "abort"
            aborted.add(rid)
        assert len(engine.scheduler.running) <= 32
    assert engine.scheduler.num_preemptions > 0
    assert aborted and aborted <= doomed
    for i, rid in enumerate(ids):
        if rid in aborted:
            assert rid not in finished
            continue
        assert finished[rid].outputs[0].token_ids == reference[i], rid
        assert finished[rid].outputs[0].finish_reason == "length"
    assert engine.kv_manager.pool.is_whole()
    assert not engine.scheduler.requests and not engine.states
