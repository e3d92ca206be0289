"""Structured output constraints: validation, cache keys, the front's check, the API's request fields.
No model: grammars are parsed by xgrammar, requests by the pydantic protocol."""
import json

import pytest

from splitserve.entrypoints.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest
from splitserve.sampling_params import SamplingParams, StructuredOutputsParams
from splitserve.structured_output.grammar import check_structured_outputs, choice_ebnf

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("fields,match", [
    ({}, "exactly one"),
    ({"json": SCHEMA, "regex": "a+"}, "exactly one"),
    ({"json": 5}, "JSON schema"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"choice": ["a", 3]}, "choice must be a non-empty list"),
    ({"grammar": 7}, "grammar must be a non-empty string"),
    ({"regex": "a", "whitespace_pattern": " "}, "whitespace_pattern is not supported"),
])
def test_invalid_constraints_raise(fields, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**fields)


def test_keys_are_canonical():
    """A schema given as an object or as text, in any key order, shares one compiled grammar."""
    a = StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "string"}}})
    b = StructuredOutputsParams(json='{"properties": {"x": {"type": "string"}}, "type": "object"}')
    assert a.key() == b.key()
    assert a.key() != StructuredOutputsParams(json=a.json, disable_any_whitespace=True).key()
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


@pytest.mark.parametrize("fields,match", [
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": {"type": "fancy"}}, 'invalid json schema: Unsupported type "fancy"'),
    ({"json": {"type": "string", "pattern": "(a"}}, "invalid json schema"),
    ({"regex": "(ab"}, "invalid regex: .*parenthesis"),
    ({"grammar": "root ::= foo"}, 'invalid grammar: .*Rule "foo" is not defined'),
    ({"grammar": "start ::= \"a\""}, "invalid grammar"),
])
def test_front_check_gives_the_reason(fields, match):
    with pytest.raises(ValueError, match=match):
        check_structured_outputs(StructuredOutputsParams(**fields))


def test_choice_grammar_accepts_exactly_the_choices():
    import xgrammar as xgr
    from splitserve.loading.resolve import load_tokenizer
    choices = ['say "hi"', "back\\slash", "two\nlines", "é"]
    info = xgr.TokenizerInfo.from_huggingface(load_tokenizer(None))
    compiled = xgr.GrammarCompiler(info).compile_grammar(xgr.Grammar.from_ebnf(choice_ebnf(choices)))
    for text in choices + ['say "hi" ', "two lines", "e"]:
        m = xgr.GrammarMatcher(compiled)
        assert (m.accept_string(text) and m.is_completed()) == (text in choices), text


def test_sampling_params_new_fields():
    p = SamplingParams(logit_bias={"5": -100, 7: 50.5}, allowed_token_ids=[1, 2], bad_words=["foo"],
                       structured_outputs={"regex": "a+"})
    assert p.logit_bias == {5: -100.0, 7: 50.5}
    assert isinstance(p.structured_outputs, StructuredOutputsParams) and p.structured_outputs.regex == "a+"
    child = p.for_child(1)
    assert child.structured_outputs == p.structured_outputs and child.logit_bias == p.logit_bias
    for bad, match in [({"logit_bias": {"x": 1}}, "logit_bias keys"), ({"logit_bias": {"1": 101}}, "logit_bias values"),
                       ({"logit_bias": {"-3": 1}}, "non-negative"), ({"logit_bias": {"1": float("nan")}}, "logit_bias"),
                       ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
                       ({"bad_words": "foo"}, "bad_words"), ({"bad_words": [""]}, "bad_words")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**bad)


# -- the API's request fields ---------------------------------------------------------------------------
MSGS = [{"role": "user", "content": "hi"}]


def chat(**fields) -> SamplingParams:
    return ChatCompletionRequest(messages=MSGS, **fields).to_sampling_params()


def test_response_format_and_vllm_fields_become_one_constraint():
    so = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}})
    assert so.structured_outputs.json == SCHEMA
    assert chat(response_format={"type": "json_object"}).structured_outputs.json_object
    assert chat(response_format={"type": "text"}).structured_outputs is None
    assert chat(guided_json=json.dumps(SCHEMA)).structured_outputs.key() == so.structured_outputs.key()
    assert chat(guided_regex="[0-9]+").structured_outputs.regex == "[0-9]+"
    assert chat(guided_choice=["a", "b"]).structured_outputs.choice == ["a", "b"]
    assert chat(guided_grammar='root ::= "x"').structured_outputs.grammar == 'root ::= "x"'
    req = ChatCompletionRequest(messages=MSGS, guided_regex="a")
    req.to_sampling_params()
    assert req.constraint_field == "guided_regex"  # the param of an error found when it is compiled
    got = chat(structured_outputs={"choice": ["y"], "disable_any_whitespace": True}).structured_outputs
    assert got.choice == ["y"] and got.disable_any_whitespace
    c = CompletionRequest(prompt="hi", guided_regex="a", logit_bias={"3": -100}, allowed_token_ids=[3, 4],
                          bad_words=["no"]).to_sampling_params()
    assert (c.structured_outputs.regex, c.logit_bias, c.allowed_token_ids, c.bad_words) == ("a", {3: -100.0}, [3, 4], ["no"])


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "str"}}}, "response_format"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"nonsense": 1}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"logit_bias": {"1": 500}}, "logit_bias"),
    ({"logit_bias": {"one": 5}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
])
def test_bad_request_fields_are_400_naming_the_field(fields, param):
    with pytest.raises(APIError) as e:
        chat(**fields)
    assert e.value.status == 400 and e.value.param == param, e.value.message
