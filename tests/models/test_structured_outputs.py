"""Structured outputs and per-request logit changes on the real default model (SmolLM2-135M-Instruct).

Constrained outputs are checked by independent means: JSON parsed by `json` and validated by
`jsonschema`, regexes by `re.fullmatch`, grammars by an equivalent regex. Sampled requests carry seeds,
so each test is deterministic."""
import json
import re
import threading
import time

import jsonschema
import pytest

from splitserve import LLM, SamplingParams
from splitserve.loading.resolve import load_tokenizer
from splitserve.sampling_params import StructuredOutputsParams as SO
from tests.hf_reference import make_tiny_llama_dir

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "maxLength": 40},
        "is_student": {"type": "boolean"},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "is_student", "hobbies"],
}


@pytest.fixture(scope="module")
def llm():
    return LLM(num_blocks=1024)


def chat_prompt(llm, text: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": text}])


def assert_clean(llm) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.pool.is_whole()
    assert not engine.core.structured.live and not engine.runner.input_batch.states


def test_json_schema_outputs_validate_fifty_times_in_a_row(llm):
    prompt = chat_prompt(llm, "Describe a person as a JSON object with name, age, city, is_student and hobbies.")
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=200, structured_outputs=SO(json=PERSON))
              for i in range(50)]
    outs = llm.generate([prompt] * 50, params, use_tqdm=False)
    for out in outs:
        o = out.outputs[0]
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), PERSON)
    assert len({o.outputs[0].text for o in outs}) > 10  # sampled, not one answer repeated
    assert_clean(llm)


def test_regex_choice_grammar_and_json_object_in_one_batch(llm):
    prompt = chat_prompt(llm, "Answer briefly: what is a good name for a cat?")
    cases = [
        (SO(regex=r"[A-Z][a-z]{2,8}-[0-9]{3}"), lambda t: re.fullmatch(r"[A-Z][a-z]{2,8}-[0-9]{3}", t)),
        (SO(choice=["yes", "no", 'maybe "later"']), lambda t: t in ("yes", "no", 'maybe "later"')),
        (SO(grammar='root ::= "(" item ("," item)* ")"\nitem ::= [a-z]+'),
         lambda t: re.fullmatch(r"\([a-z]+(,[a-z]+)*\)", t)),
        (SO(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        (SO(json={"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
            disable_any_whitespace=True), lambda t: re.fullmatch(r"\[-?\d+(, -?\d+){1,3}\]", t)),  # compact: ", " only
    ]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=60, structured_outputs=so)
              for so, _ in cases for s in range(4)]
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    for i, out in enumerate(outs):
        o = out.outputs[0]
        if o.finish_reason == "length" and cases[i // 4][0].kind in ("grammar", "json_object"):
            continue  # these languages are unbounded: a sample may run to max_tokens
        assert o.finish_reason == "stop" and cases[i // 4][1](o.text), (cases[i // 4][0], o.text)
    assert_clean(llm)


def test_parallel_samples_each_follow_the_constraint(llm):
    out = llm.generate([chat_prompt(llm, "Pick a colour.")],
                       SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=10,
                                      structured_outputs=SO(choice=["red", "green", "blue"])), use_tqdm=False)[0]
    assert len(out.outputs) == 4 and all(o.text in ("red", "green", "blue") for o in out.outputs)


@pytest.mark.parametrize("so,match", [
    (SO(json={"type": "fancy"}), "invalid json schema"),
    (SO(regex="(ab"), "invalid regex"),
    (SO(grammar="root ::= missing"), "invalid grammar"),
])
def test_invalid_constraints_raise_and_queue_nothing(llm, so, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["Hello", "Hi"], [SamplingParams(), SamplingParams(structured_outputs=so)], use_tqdm=False)
    assert_clean(llm)


def test_unconstrained_requests_are_unchanged_by_constrained_ones(llm):
    prompts = [chat_prompt(llm, q) for q in ("What is the capital of France?", "Name three fruits.")]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    constrained = SamplingParams(temperature=1.0, seed=1, max_tokens=40, structured_outputs=SO(json=PERSON))
    mixed = llm.generate([prompts[0], prompts[0], prompts[1], prompts[1]], [greedy, constrained, greedy, constrained],
                         use_tqdm=False)
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone


def test_logit_bias_bans_and_forces(llm):
    prompt = chat_prompt(llm, "What is the capital of France?")
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids[0]
    banned = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                   logit_bias={first: -100}), use_tqdm=False)[0].outputs[0]
    assert first not in banned.token_ids
    forced_id = llm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    forced = llm.generate([prompt] * 3, [SamplingParams(temperature=1.0, seed=s, max_tokens=5, ignore_eos=True,
                                                        logit_bias={forced_id: 100}) for s in range(3)],
                          use_tqdm=False)
    assert all(o.outputs[0].token_ids == [forced_id] * 5 for o in forced)


def test_allowed_token_ids_and_bad_words(llm):
    prompt = chat_prompt(llm, "What is the capital of France?")
    allowed = llm.tokenizer.encode(" one two three four", add_special_tokens=False)
    outs = llm.generate([prompt] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=8, ignore_eos=True,
                                                      allowed_token_ids=allowed) for s in range(4)], use_tqdm=False)
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in outs)
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    assert "Paris" in plain.text
    no_paris = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, bad_words=["Paris"]),
                            use_tqdm=False)[0].outputs[0]
    assert "Paris" not in no_paris.text
    ids = no_paris.token_ids
    for seq in llm.engine.front.bad_words_token_ids(["Paris"]):
        assert not any(ids[i:i + len(seq)] == seq for i in range(len(ids)))
    assert_clean(llm)


def test_min_tokens_holds_back_eos(llm):
    prompt = chat_prompt(llm, "Reply with just the word OK.")
    short = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)[0].outputs[0]
    eos = set(llm.engine.config.model.eos_token_ids)
    assert short.finish_reason == "stop" and short.token_ids[-1] in eos
    n = len(short.token_ids) + 5
    held = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60, min_tokens=n),
                        use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= n and not eos & set(held.token_ids[:n])
    # Identical until the EOS it had to skip.
    assert held.token_ids[:len(short.token_ids) - 1] == short.token_ids[:-1]


def test_abort_while_compiling_and_while_generating_leaves_the_pool_whole(llm, monkeypatch):
    engine = llm.engine
    prompt = chat_prompt(llm, "Write a long string.")
    slow = SO(json={"type": "string", "minLength": 7})
    # Hold this one grammar back (as if compiling) until the test has seen the request wait (a large
    # schema alone compiled in under a step on a fast machine, so the wait was not guaranteed).
    release = threading.Event()
    manager = engine.core.structured
    real_is_ready = manager.is_ready

    def held_is_ready(request):
        if request.request_id == "compiling" and not release.is_set():
            return False
        return real_is_ready(request)

    monkeypatch.setattr(manager, "is_ready", held_is_ready)
    engine.add_request("compiling", prompt, SamplingParams(max_tokens=5, structured_outputs=slow))
    engine.add_request("plain", prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outs = {}
    while "plain" not in outs:  # the unconstrained request runs while the other one waits for its grammar
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert [r.request_id for r in engine.scheduler.waiting] == ["compiling"]
    engine.abort_request("compiling")
    release.set()
    engine.add_request("gen", prompt, SamplingParams(temperature=1.0, seed=0, max_tokens=100,
                                                     structured_outputs=SO(json=PERSON)))
    deadline = time.monotonic() + 120
    while not engine.scheduler.requests.get("gen") or len(engine.scheduler.requests["gen"].output_token_ids) < 3:
        assert time.monotonic() < deadline
        engine.step()
    engine.abort_request("gen")
    while engine.has_unfinished_requests():
        engine.step()
    assert_clean(llm)


def test_async_scheduling_gives_the_same_constrained_outputs(llm):
    overlapped = LLM(num_blocks=1024, async_scheduling=True)
    assert overlapped.engine.core.async_scheduling
    prompts = [chat_prompt(llm, "Describe a person as JSON."), chat_prompt(llm, "Say something.")]
    params = [SamplingParams(temperature=0, max_tokens=80, structured_outputs=SO(json=PERSON)),
              SamplingParams(temperature=1.0, seed=5, max_tokens=80, structured_outputs=SO(json=PERSON)),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=2, max_tokens=20, structured_outputs=SO(regex="[a-z ]{5,30}"))]
    batch = [prompts[0], prompts[0], prompts[1], prompts[1]]
    ref = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in overlapped.generate(batch, params, use_tqdm=False)]
    assert got == ref
    jsonschema.validate(json.loads(llm.tokenizer.decode(ref[0], skip_special_tokens=True)), PERSON)
    assert_clean(overlapped)


def test_padding_ids_of_a_wider_vocabulary_are_never_sampled(tmp_path):
    """A random tiny model whose vocabulary has 37 ids past the tokenizer's: unconstrained sampling
    picks them, constrained sampling never does."""
    tokenizer = load_tokenizer(None)
    real = len(tokenizer)
    path = make_tiny_llama_dir(tmp_path, tokenizer, num_kv_heads=2, tie=False, vocab_size=real + 37)
    tiny = LLM(path, num_blocks=256)
    # Make the padding ids the likeliest tokens, whatever the weights.
    with_bias = {real + i: 30.0 for i in range(37)}
    free = tiny.generate([[5, 6, 7]], SamplingParams(temperature=1.0, seed=0, max_tokens=8, ignore_eos=True,
                                                    logit_bias=with_bias), use_tqdm=False)[0].outputs[0]
    assert all(t >= real for t in free.token_ids)
    constrained = tiny.generate([[5, 6, 7]] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=12,
                                                                 logit_bias=with_bias,
                                                                 structured_outputs=SO(regex="[a-z]{3,10}"))
                                                  for s in range(4)], use_tqdm=False)
    for out in constrained:
        o = out.outputs[0]
        assert all(t < real for t in o.token_ids) and re.fullmatch("[a-z]{3,10}", o.text), o


def test_a_sampler_that_fails_after_the_masks_fails_its_step_only(llm):
    """Async scheduling: a launched step gets its masks after its forward and its sampler is enqueued
    afterwards. When that sampler raises once, the requests of that step end with an error; later
    requests run normally and the pool, the worker's batch and the grammar state end whole."""
    overlapped = LLM(num_blocks=1024, async_scheduling=True)
    runner = overlapped.engine.runner
    prompt = chat_prompt(llm, "Describe a person as JSON.")
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=SO(json=PERSON)),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]
    # The grammar compiled first (and the grammar process started), so that both requests below
    # are admitted together and share the step whose sampler fails.
    overlapped.generate([prompt], params[:1], use_tqdm=False)
    real_sample, calls = runner.sample, []

    def failing_once(step, bitmask):
        calls.append(bitmask.shape)
        if len(calls) == 3:
            raise RuntimeError("injected sampler failure")
        return real_sample(step, bitmask)

    runner.sample = failing_once
    failed = overlapped.generate([prompt, prompt], params, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in failed] == ["error", "error"]
    assert len(calls) == 3
    runner.sample = real_sample
    again = overlapped.generate([prompt], params[:1], use_tqdm=False)[0].outputs[0]
    ref = llm.generate([prompt], params[:1], use_tqdm=False)[0].outputs[0]
    assert again.token_ids == ref.token_ids and again.finish_reason == ref.finish_reason
    assert_clean(overlapped)
