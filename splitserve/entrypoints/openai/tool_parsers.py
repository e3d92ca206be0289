"""Tool calls read out of model text, in the formats models are trained on (vLLM's parser names).

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call; text before
  the first block is the message's content. A last block the model left unclosed (it stopped at EOS)
  still counts when its JSON is whole.
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` objects (or one object);
  the newer `[TOOL_CALLS]name[ARGS]{...}` spelling too.
- `llama3_json`: the whole answer is `{"name": ..., "parameters": {...}}` (or "arguments"), several
  separated by `;`, optionally after `<|python_tag|>` (text before the tag is content).

One rule for every format: text that starts a tool call but does not parse into well-formed calls is
returned unchanged as plain content, with no calls. Streaming (StreamingToolExtractor) streams content
until a call's start marker could begin, then holds the rest back and, at the end, runs the same
extraction on the whole text, so streamed and non-streamed answers always agree.
"""
from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass

PARSERS = ("hermes", "llama3_json", "mistral")


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object, as the OpenAI API carries it


@dataclass
class Extracted:
    content: str | None
    calls: list[ToolCall]


def new_call_id(parser: str | None = None) -> str:
    if parser == "mistral":  # Mistral's templates require ids of exactly 9 letters or digits
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return f"call_{secrets.token_hex(12)}"


def _call_from(obj, parser: str, args_keys: tuple[str, ...] = ("arguments",)) -> ToolCall:
    """One {"name", "arguments"} object -> ToolCall; ValueError when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ValueError("not a tool call object")
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as JSON text
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError("tool call arguments are not an object")
    return ToolCall(new_call_id(parser), obj["name"], json.dumps(args, ensure_ascii=False))


def _json_prefix(text: str, start: int = 0):
    """The JSON value at text[start:] (after whitespace) and the index just past it."""
    decoder = json.JSONDecoder()
    i = start
    while i < len(text) and text[i].isspace():
        i += 1
    return decoder.raw_decode(text, i)


class ToolParser:
    name = ""
    # Markers a call may start with; content before the first is streamed as it comes.
    start_markers: tuple[str, ...] = ()
    # Whether the markers are special tokens, which a detokenizer skipping them would drop.
    needs_special_tokens = False

    def extract(self, text: str) -> Extracted:
        """The content and calls in a finished answer. Malformed calls: the whole text as content."""
        start = self.call_start(text)
        if start is None:
            return Extracted(text, [])
        try:
            calls = self._parse_calls(text[start:])
        except ValueError:
            return Extracted(text, [])
        if not calls:
            return Extracted(text, [])
        content = text[:start]
        return Extracted(content if content.strip() else None, calls)

    def call_start(self, text: str) -> int | None:
        found = [i for i in (text.find(m) for m in self.start_markers) if i >= 0]
        return min(found) if found else None

    def _parse_calls(self, text: str) -> list[ToolCall]:
        raise NotImplementedError


class HermesToolParser(ToolParser):
    name = "hermes"
    start_markers = ("<tool_call>",)
    _OPEN, _CLOSE = "<tool_call>", "</tool_call>"

    def _parse_calls(self, text: str) -> list[ToolCall]:
        calls, i = [], 0
        while True:
            i = text.find(self._OPEN, i)
            if i < 0:
                return calls
            body_start = i + len(self._OPEN)
            end = text.find(self._CLOSE, body_start)
            body = text[body_start:] if end < 0 else text[body_start:end]
            calls.append(_call_from(json.loads(body), self.name))
            if end < 0:
                return calls
            i = end + len(self._CLOSE)
            if text[i:].strip() and not text[i:].lstrip().startswith(self._OPEN):
                raise ValueError("text after a tool call")


class MistralToolParser(ToolParser):
    name = "mistral"
    start_markers = ("[TOOL_CALLS]",)
    needs_special_tokens = True
    _MARK, _ARGS = "[TOOL_CALLS]", "[ARGS]"

    def _parse_calls(self, text: str) -> list[ToolCall]:
        calls = []
        for part in text.split(self._MARK)[1:]:
            if self._ARGS in part:  # newer spelling: [TOOL_CALLS]name[ARGS]{...}
                name, _, args = part.partition(self._ARGS)
                value, end = _json_prefix(args)
                if args[end:].strip():
                    raise ValueError("text after a tool call")
                calls.append(_call_from({"name": name.strip(), "arguments": value}, self.name))
                continue
            value, end = _json_prefix(part)
            if part[end:].strip():
                raise ValueError("text after the tool calls")
            for obj in value if isinstance(value, list) else [value]:
                calls.append(_call_from(obj, self.name))
        return calls


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start_markers = ("<|python_tag|>",)
    needs_special_tokens = True
    _TAG = "<|python_tag|>"

    def call_start(self, text: str) -> int | None:
        i = text.find(self._TAG)
        if i >= 0:
            return i
        stripped = len(text) - len(text.lstrip())
        return stripped if text[stripped:stripped + 1] == "{" else None

    def _parse_calls(self, text: str) -> list[ToolCall]:
        if text.startswith(self._TAG):
            text = text[len(self._TAG):]
        calls, i = [], 0
        while True:
            value, i = _json_prefix(text, i)
            calls.append(_call_from(value, self.name, ("parameters", "arguments")))
            rest = text[i:].lstrip()
            if not rest:
                return calls
            if not rest.startswith(";"):
                raise ValueError("text after a tool call")
            i = len(text) - len(rest) + 1


_BY_NAME = {p.name: p for p in (HermesToolParser, MistralToolParser, Llama3JsonToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    if name not in _BY_NAME:
        raise ValueError(f"unknown tool call parser {name!r} (choose from {', '.join(PARSERS)})")
    return _BY_NAME[name]()


def _held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of text could be the start of a marker."""
    keep = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:n]):
                keep = max(keep, n)
                break
    return keep


class StreamingToolExtractor:
    """Feeds on text deltas; gives content deltas while no call has begun. Once a start marker (or,
    for llama3_json, a leading `{`) appears, the rest is held; finish() extracts from the whole text
    and gives the remaining content (when the calls were malformed) and the calls."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.sent = 0          # characters of text already given out as content
        self.in_call = False

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.in_call:
            return ""
        start = self.parser.call_start(self.text)
        if start is None and isinstance(self.parser, Llama3JsonToolParser) and not self.text.strip():
            return ""  # a llama3 answer that starts with whitespace may still be a call
        if start is not None:
            self.in_call = True
            out, self.sent = self.text[self.sent:start], start
            return out
        limit = len(self.text) - _held_back(self.text, self.parser.start_markers)
        out, self.sent = self.text[self.sent:limit], max(self.sent, limit)
        return out

    def finish(self) -> Extracted:
        """Content not yet given out, and the calls (empty when the answer held none or malformed ones)."""
        result = self.parser.extract(self.text)
        rest = self.text[self.sent:]
        if result.calls:
            return Extracted(None, result.calls)
        return Extracted(rest or None, [])
