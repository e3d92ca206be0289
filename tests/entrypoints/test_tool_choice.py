"""tool_choice plans: which requests are refused, and the JSON schemas that constrain required / named
answers, checked with jsonschema on hand-written instances."""
from __future__ import annotations

import jsonschema
import pytest

from splitserve.entrypoints.openai.protocol import APIError
from splitserve.entrypoints.openai.tool_choice import plan_tools, template_message

A = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
TOOLS = [{"type": "function", "function": {"name": "a", "parameters": A}},
         {"type": "function", "function": {"name": "b"}}]


def test_auto_needs_the_server_flags():
    with pytest.raises(APIError, match="--enable-auto-tool-choice") as e:
        plan_tools(TOOLS, None, True, None)  # tools without tool_choice mean auto
    assert e.value.status == 400
    assert plan_tools(TOOLS, "auto", True, "hermes").mode == "auto"
    assert plan_tools(TOOLS, "none", True, None).schema() is None
    assert plan_tools(None, None, True, None) is None


def test_required_schema_accepts_calls_and_refuses_others():
    schema = plan_tools(TOOLS, "required", True, None).schema()
    jsonschema.validate([{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}], schema)
    for bad in ([], [{"name": "c", "parameters": {}}], [{"name": "a", "parameters": {"x": "1"}}],
                [{"name": "a"}], {"name": "a", "parameters": {"x": 1}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = plan_tools(TOOLS, "required", False, None).schema()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "b", "parameters": {}}] * 2, one)


def test_named_schema_is_the_functions_parameters():
    plan = plan_tools(TOOLS, {"type": "function", "function": {"name": "a"}}, True, None)
    assert plan.schema() == A
    [call] = plan.calls_from_constrained(' {"x": 3} ')
    assert (call.name, call.arguments) == ("a", '{"x": 3}')


@pytest.mark.parametrize("tools,choice,match", [
    (TOOLS, {"type": "function", "function": {"name": "zzz"}}, "not among the tools"),
    (TOOLS, "always", "not one of"),
    ([{"type": "retrieval"}], "required", "only tools of type 'function'"),
    ([{"type": "function", "function": {"name": "a", "parameters": "x"}}], "required", "JSON schema object"),
    (TOOLS + TOOLS[:1], "required", "given twice"),
    (None, "required", "needs tools"),
])
def test_bad_requests(tools, choice, match):
    with pytest.raises(APIError, match=match):
        plan_tools(tools, choice, True, None)


def test_template_message_turns_arguments_into_objects():
    msg = template_message("assistant", "", None, {"tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "a", "arguments": '{"x": 2}'}}]})
    assert msg["tool_calls"][0]["function"]["arguments"] == {"x": 2}
    assert template_message("tool", "21", None, {"tool_call_id": "call_1"})["tool_call_id"] == "call_1"
    with pytest.raises(APIError, match="not JSON"):
        template_message("assistant", "", None, {"tool_calls": [{"function": {"name": "a", "arguments": "{x"}}]})
