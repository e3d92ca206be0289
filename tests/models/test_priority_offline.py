"""Priority scheduling through the offline engine (a tiny random Llama): with one sequence at a time
the requests run in (priority, arrival) order; the fcfs engine refuses a non-zero priority; the pool
is whole afterwards."""
import pytest

from splitserve import LLM, SamplingParams
from splitserve.loading.resolve import load_tokenizer
from tests.hf_reference import make_tiny_llama_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny-priority"), load_tokenizer(None), num_kv_heads=2,
                               tie=True, seed=3)


def test_requests_run_in_priority_order(model_dir):
    llm = LLM(model_dir, scheduling_policy="priority", max_num_seqs=1, max_model_len=128)
    priorities = [3, 1, 2, -4, 1]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    outs = llm.generate([f"request {i}" for i in range(5)], params, use_tqdm=False, priority=priorities)
    ran = sorted(range(5), key=lambda i: outs[i].first_token_time)
    # (priority, position): equal priorities in arrival order
    assert ran == sorted(range(5), key=lambda i: (priorities[i], i)) == [3, 1, 4, 2, 0]
    assert llm.engine.kv_manager.pool.is_whole()
    with pytest.raises(ValueError, match="priorities for"):
        llm.generate(["a", "b"], params, priority=[1])


def test_fcfs_engine_refuses_priority(model_dir):
    llm = LLM(model_dir, max_model_len=128)
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        llm.generate(["a", "b"], SamplingParams(max_tokens=2), priority=[0, 1])
    assert not llm.engine.has_unfinished_requests()  # nothing was queued
    out = llm.generate(["a"], SamplingParams(max_tokens=2), priority=[0])
    assert len(out[0].outputs[0].token_ids) >= 1
    with pytest.raises(ValueError, match="scheduling policy must be one of"):
        LLM(model_dir, scheduling_policy="lifo")
