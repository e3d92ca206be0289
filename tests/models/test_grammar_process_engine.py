"""Structured outputs through `LLM` with the grammar process (the default) against the in-process fill
(`structured_outputs_fill="inline"`), on the default model: the same greedy outputs through
preemptions, with async scheduling (tests/models/test_structured_outputs.py runs the process without
it); a killed grammar process ends only its requests."""
import json

import jsonschema
import pytest

from splitserve import LLM, SamplingParams
from splitserve.sampling_params import StructuredOutputsParams as SO

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer"},
                   "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}},
    "required": ["name", "age", "hobbies"],
}


def prompts_and_params(llm):
    questions = ["Describe a person as JSON.", "Name a city.", "Write a short poem.", "Pick a colour.",
                 "Describe your best friend as JSON.", "Count to five."]
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    params = [SamplingParams(temperature=0, max_tokens=50, structured_outputs=SO(json=PERSON)),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, structured_outputs=SO(regex=r"[A-Z][a-z ]{3,30}")),
              SamplingParams(temperature=0, max_tokens=8, structured_outputs=SO(choice=["red", "green", "blue"])),
              SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs=SO(json=PERSON)),
              SamplingParams(temperature=0, max_tokens=30, structured_outputs=SO(
                  grammar='root ::= num (" " num)*\nnum ::= [1-9]'))]
    return prompts, params


# A KV cache too small for the batch: requests are preempted and recomputed (their matchers keep their
# state in the grammar process). Async scheduling: the rows are taken a step call after the tokens went.
SMALL = dict(num_blocks=12, block_size=16, max_num_batched_tokens=128, async_scheduling=True)


@pytest.fixture(scope="module")
def inline():
    return LLM(structured_outputs_fill="inline", **SMALL)


@pytest.fixture(scope="module")
def process():
    return LLM(**SMALL)


def test_outputs_equal_the_in_process_fill_through_preemptions(inline, process):
    prompts, params = prompts_and_params(inline)
    prompts, params = prompts * 2, params * 2
    ref = inline.generate(prompts, params, use_tqdm=False)
    got = process.generate(prompts, params, use_tqdm=False)
    structured = process.engine.core.structured
    assert structured.fills_elsewhere and structured.process.poll() is None
    assert process.engine.core.scheduler.num_preemptions > 0 and inline.engine.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in ref]
    if got[0].outputs[0].finish_reason == "stop":
        jsonschema.validate(json.loads(got[0].outputs[0].text), PERSON)
    assert got[3].outputs[0].text in ("red", "green", "blue")
    assert not structured.live and not process.engine.has_unfinished_requests()


def test_a_killed_grammar_process_ends_the_constrained_requests_only(inline, process):
    prompts, params = prompts_and_params(inline)
    llm = process
    plain = params[1]
    ref = inline.generate([prompts[1]], plain, use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.engine
    ids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
    outputs = {}
    killed = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        structured = engine.core.structured
        if not killed and structured.process is not None and any(
                len(r.output_token_ids) >= 3 for r in structured.live.values()):
            structured.process.kill()
            killed = True
    assert killed
    for rid, sp in zip(ids, params):
        o = outputs[rid].outputs[0]
        if sp.structured_outputs is None:
            assert o.finish_reason == "length" and o.token_ids == ref
        elif o.finish_reason != "stop":  # the choice may have completed before the kill
            assert o.finish_reason == "error"
    assert sum(outputs[rid].outputs[0].finish_reason == "error" for rid in ids) >= 3
    # The engine goes on serving, constrained requests included (a new grammar process).
    again = llm.generate([prompts[3]], params[3], use_tqdm=False)[0].outputs[0]
    assert again.text in ("red", "green", "blue") and again.finish_reason == "stop"
    assert not engine.has_unfinished_requests() and not engine.core.structured.live


def test_the_process_starts_with_the_engine_and_restarts_are_bounded(inline):
    """With a GPU the grammar process is started by the engine's start-up, before any request; on
    CPU (the model's threads use every core) by the first constrained request. Killed three times,
    it is restarted twice (by the next constrained request each time), then no more: the constrained
    request that found the third one dead fails at once with the reason, and plain requests go on
    as before."""
    prompts, params = prompts_and_params(inline)
    plain, choice = params[1], params[3]
    ref = inline.generate([prompts[1]], plain, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(**SMALL)
    try:
        structured = llm.engine.core.structured
        first = structured.process
        if llm.engine.core.config.device.startswith("cuda"):
            assert first is not None and first.poll() is None and not structured.live  # no request yet
        else:
            assert first is None
        pids = []
        for _ in range(3):
            out = llm.generate([prompts[3]], choice, use_tqdm=False)[0].outputs[0]
            assert out.finish_reason == "stop" and out.text in ("red", "green", "blue")
            pids.append(structured.process.pid)
            structured.process.kill()
            structured.process.wait()
        assert (first is None or pids[0] == first.pid) and len(set(pids)) == 3
        out = llm.generate([prompts[3], prompts[1]], [choice, plain], use_tqdm=False)
        assert out[0].outputs[0].finish_reason == "error" and structured.process is None
        assert "lost 3 times" in out[0].outputs[0].stop_reason and "not restarted" in out[0].outputs[0].stop_reason
        assert out[1].outputs[0].finish_reason == "length" and out[1].outputs[0].token_ids == ref
        assert llm.generate([prompts[3]], choice, use_tqdm=False)[0].outputs[0].finish_reason == "error"
        assert not llm.engine.has_unfinished_requests() and not structured.live
    finally:
        llm.engine.core.shutdown()
