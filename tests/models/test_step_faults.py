"""Injected model-step faults at the engine level: a faulted step fails exactly its requests (finish
reason "error"), the others get their fault-free tokens, no KV block leaks; three failed steps in a
row make the engine raise EngineDeadError. Also the fault spec parser."""
import random

import pytest

from splitserve import LLM, SamplingParams
from splitserve.fault_injection import install_step_faults, parse_spec
from splitserve.engine.llm_engine import MAX_FAILED_STEPS_IN_A_ROW, EngineDeadError
from splitserve.loading.resolve import load_tokenizer
from tests.hf_reference import make_tiny_llama_dir

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny"), load_tokenizer(None), num_kv_heads=2, tie=True, seed=3)


def test_parse_spec():
    assert parse_spec("every=5") == (5, None)
    assert parse_spec("from=2, every=3") == (3, 2)
    for bad in ("", "every=0", "every=x", "sometimes=3", "every"):
        with pytest.raises(ValueError):
            parse_spec(bad)


def test_a_faulted_step_fails_only_its_requests(model_dir):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 40000) for _ in range(rng.randrange(2, 30))] for _ in range(40)]
    reference = [o.outputs[0].token_ids for o in LLM(model_dir, num_blocks=256).generate(prompts, PARAMS, use_tqdm=False)]

    llm = LLM(model_dir, num_blocks=256, max_num_seqs=4)
    engine = llm.engine
    assert install_step_faults(engine.runner, "every=13")  # batches live 6 steps: some hit, some not
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, PARAMS, stream=False)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out.outputs[0]
    assert len(finished) == len(prompts)
    errors = [rid for rid, o in finished.items() if o.finish_reason == "error"]
    assert 0 < len(errors) < len(prompts)
    for i in range(len(prompts)):
        o = finished[f"r{i}"]
        if o.finish_reason != "error":
            assert o.finish_reason == "length" and o.token_ids == reference[i], i
    assert engine.kv_manager.pool.is_whole()
    assert not engine.scheduler.requests and not engine.states


def test_failing_every_step_kills_the_engine(model_dir):
    engine = LLM(model_dir, num_blocks=64).engine
    install_step_faults(engine.runner, "from=1")
    failed = 0
    with pytest.raises(EngineDeadError, match="in a row"):
        for i in range(10):
            engine.add_request(f"r{i}", [5, 6, 7], PARAMS)
            while engine.has_unfinished_requests():
                outs = engine.step()
                failed += sum(o.outputs[0].finish_reason == "error" for o in outs)
    assert failed == MAX_FAILED_STEPS_IN_A_ROW - 1
