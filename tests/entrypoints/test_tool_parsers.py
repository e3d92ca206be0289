"""Tool-call parsers on hand-written model outputs, whole and streamed in arbitrary splits.

Expected calls are written out by hand here (name + arguments as Python objects), not produced by the
code under test."""
from __future__ import annotations

import json
import random

import pytest

from splitserve.entrypoints.openai.tool_parsers import StreamingToolExtractor, get_tool_parser

W = {"city": "Paris", "unit": "celsius"}
T = {"tz": "Europe/Paris"}

# parser, model text, expected content (None: none), expected calls [(name, arguments)]
CASES = [
    # hermes
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     None, [("get_weather", W)]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>\n'
               '<tool_call>{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}</tool_call>',
     None, [("get_weather", W), ("get_time", T)]),
    ("hermes", 'Let me look that up.\n<tool_call>{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}</tool_call>',
     "Let me look that up.\n", [("get_time", T)]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}',  # unclosed at EOS
     None, [("get_time", T)]),
    ("hermes", 'No tools needed: the sky is blue.', "No tools needed: the sky is blue.", []),
    ("hermes", 'x <tool_call>{"name": "get_time", "arguments": {"tz": </tool_call>',
     'x <tool_call>{"name": "get_time", "arguments": {"tz": </tool_call>', []),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    # mistral
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
     None, [("get_weather", W)]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]',
     None, [("get_weather", W), ("get_time", T)]),
    ("mistral", 'Checking. [TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]',
     "Checking. ", [("get_time", T)]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
                '[TOOL_CALLS]get_time[ARGS]{"tz": "Europe/Paris"}',
     None, [("get_weather", W), ("get_time", T)]),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "Eu',
     '[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "Eu', []),
    ("mistral", 'It is [sunny] today.', "It is [sunny] today.", []),
    # llama3_json
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     None, [("get_weather", W)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                    '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}',
     None, [("get_weather", W), ("get_time", T)]),
    ("llama3_json", 'Sure.<|python_tag|>{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}',
     "Sure.", [("get_time", T)]),
    ("llama3_json", '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}} and then some',
     '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}} and then some', []),
    ("llama3_json", '{"city": "Paris"}', '{"city": "Paris"}', []),
    ("llama3_json", 'Plain answer {with braces}.', "Plain answer {with braces}.", []),
]


def _as_pairs(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_extract(parser, text, content, calls):
    got = get_tool_parser(parser).extract(text)
    assert _as_pairs(got.calls) == calls
    assert got.content == content
    assert all(c.id for c in got.calls) and len({c.id for c in got.calls}) == len(got.calls)


def _stream(parser, pieces):
    ex = StreamingToolExtractor(get_tool_parser(parser))
    content = "".join(ex.feed(p) for p in pieces)
    result = ex.finish()
    return content + (result.content or ""), result.calls


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_streamed_in_random_splits_matches_whole(parser, text, content, calls):
    rng = random.Random(len(text))
    splits = [[text], list(text)]  # one piece, one character per piece
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 6))))
        splits.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    for pieces in splits:
        streamed_content, streamed_calls = _stream(parser, pieces)
        assert _as_pairs(streamed_calls) == calls, pieces
        assert (streamed_content or None) == content, pieces


def test_content_streams_before_a_marker_is_complete():
    """Text is held back only while it could still be the start of a marker."""
    ex = StreamingToolExtractor(get_tool_parser("hermes"))
    assert ex.feed("Hello <tool") == "Hello "
    assert ex.feed("box> done") == "<toolbox> done"
    assert ex.finish().calls == []


def test_mistral_ids_are_nine_alphanumerics():
    call = get_tool_parser("mistral").extract('[TOOL_CALLS][{"name": "f", "arguments": {}}]').calls[0]
    assert len(call.id) == 9 and call.id.isalnum()


def test_unknown_parser():
    with pytest.raises(ValueError, match="unknown tool call parser"):
        get_tool_parser("nope")
