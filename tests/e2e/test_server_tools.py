"""Tool calling through a real server (default SmolLM2 model) and the official `openai` client.

Calls are checked independently of the server: arguments parsed with `json` and validated with
`jsonschema` against the function's own parameters schema."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
SERVER_ARGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=900)


def _check_call(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def _collect_stream(stream) -> tuple[str, dict[int, dict], str | None]:
    """Content, calls by index, finish_reason from a chat stream; checks the OpenAI delta order."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:  # the first piece of a call names it
                assert d.id and d.type == "function" and d.function.name, d
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.id is None and not (d.function and d.function.name), d
            calls[d.index]["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def test_required_gives_valid_calls(client):
    for seed in (0, 1):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=1.0, seed=seed, max_tokens=120)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls and choice.message.content is None
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id
            _check_call(call.function.name, call.function.arguments)


def test_required_without_parallel_calls_gives_one(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, temperature=1.0, seed=7, max_tokens=120)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1
    _check_call(calls[0].function.name, calls[0].function.arguments)


def test_required_streamed_and_not_agree(client):
    """Greedy, so both answers are the same calls (at temperature 1.0 the model may add calls until
    max_tokens, which is its right with parallel_tool_calls)."""
    def ask(stream: bool):
        return client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                              temperature=0, max_tokens=120, stream=stream)
    content, calls, finish = _collect_stream(ask(True))
    assert finish == "tool_calls" and calls and not content
    whole = ask(False).choices[0].message.tool_calls
    assert [(c["name"], _check_call(c["name"], c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole]


def test_named_function_streamed_and_not_agree(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                       temperature=0, max_tokens=100)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    args = _check_call("get_weather", call.function.arguments)
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                            temperature=0, max_tokens=100, stream=True)
    content, calls, finish = _collect_stream(stream)
    assert finish == "tool_calls" and not content and list(calls) == [0]
    assert calls[0]["name"] == "get_weather"
    assert _check_call("get_weather", calls[0]["arguments"]) == args  # greedy: the same call


def test_round_trip_with_a_tool_result(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                           temperature=0, max_tokens=100)
    message = first.choices[0].message
    call = message.tool_calls[0]
    messages = ASK + [message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    for stream in (False, True):
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0,
                                           max_tokens=8, stream=stream, tool_choice="none")
        if stream:
            content, calls, finish = _collect_stream(r)
        else:
            content, calls, finish = r.choices[0].message.content, r.choices[0].message.tool_calls, \
                r.choices[0].finish_reason
        assert content and not calls and finish in ("stop", "length")


def test_tool_choice_none_gives_plain_text(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=8)
    choice = r.choices[0]
    assert choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")


def test_auto_answers(client):
    """SmolLM2's template does not show tools to the model, so whether it calls one is its own affair;
    the answer must still be well formed either way."""
    for stream in (False, True):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0,
                                           max_tokens=12, stream=stream)
        if stream:
            content, calls, finish = _collect_stream(r)
            calls = list(calls.values())
        else:
            content, calls, finish = r.choices[0].message.content, r.choices[0].message.tool_calls or [], \
                r.choices[0].finish_reason
        assert content or calls
        assert finish == ("tool_calls" if calls else finish) and finish in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("body,reason", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "fancy"}}}],
      "tool_choice": "required"}, "invalid parameters schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "fancy"}}}],
      "tool_choice": "none"}, "invalid parameters schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch_rocket"}}},
     "not among the tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "non-empty string name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "not one of"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
])
def test_invalid_tools_are_400(server, body, reason):
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": ASK, "max_tokens": 5, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert reason in err["message"] and err["param"] in ("tools", "tool_choice"), err
