"""What a chat request's `tools` / `tool_choice` ask for, checked, and how its answer becomes calls.

- `none`: plain text; tools still go to the chat template (as vLLM does by default).
- `auto` (the default when tools are given): the model chooses; the server's --tool-call-parser reads
  calls out of the text. Needs --enable-auto-tool-choice, else 400, like vLLM.
- `required` / a named function: the output is constrained by a JSON schema through the structured
  output machinery, so it is a call by construction; no parser is involved. Named: the output is the
  function's arguments object. Required: a JSON array of {"name", "parameters"} objects, one of the
  tools each (at most one when parallel_tool_calls is false).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from splitserve.entrypoints.openai.protocol import APIError
from splitserve.entrypoints.openai.tool_parsers import ToolCall, new_call_id

_ANY_OBJECT = {"type": "object"}


@dataclass
class ToolPlan:
    mode: str                      # "none", "auto", "required" or "named"
    functions: dict[str, dict]     # name -> parameters schema
    name: str | None = None        # the named function
    parallel: bool = True

    def schema(self) -> dict | None:
        """The JSON schema that constrains the output, or None when the output is free."""
        if self.mode == "named":
            return self.functions[self.name]
        if self.mode != "required":
            return None
        choices = [{"type": "object",
                    "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                    "required": ["name", "parameters"]} for name, params in self.functions.items()]
        item = choices[0] if len(choices) == 1 else {"anyOf": choices}
        array = {"type": "array", "items": item, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return array

    def calls_from_constrained(self, text: str) -> list[ToolCall] | None:
        """The calls in a constrained answer; None when it does not parse (cut short by max_tokens)."""
        if self.mode == "named":  # the text as generated, as it was streamed (even when cut short)
            return [ToolCall(new_call_id(), self.name, text.strip())]
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if not isinstance(value, list):
            return None
        return [ToolCall(new_call_id(), v["name"], json.dumps(v.get("parameters", {}), ensure_ascii=False))
                for v in value if isinstance(v, dict) and isinstance(v.get("name"), str)]


def _functions(tools: list) -> dict[str, dict]:
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise APIError(400, f"{where}: only tools of type 'function' are supported", param="tools")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f"{where}.function needs a non-empty string name", param="tools")
        params = fn.get("parameters")
        if params is None:
            params = _ANY_OBJECT
        if not isinstance(params, dict):
            raise APIError(400, f"{where}.function.parameters must be a JSON schema object", param="tools")
        if fn["name"] in functions:
            raise APIError(400, f"{where}: the function name {fn['name']!r} is given twice", param="tools")
        functions[fn["name"]] = params
    return functions


def plan_tools(tools: list | None, tool_choice, parallel_tool_calls: bool | None,
               auto_parser: str | None) -> ToolPlan | None:
    """The request's tool plan, or None when it uses no tools. `auto_parser`: the server's parser when
    --enable-auto-tool-choice is on, else None."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    functions = _functions(tools)
    parallel = parallel_tool_calls is not False
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan("none", functions, parallel=parallel)
    if choice == "auto":
        if auto_parser is None:
            raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                'to be set on the server', param="tool_choice")
        return ToolPlan("auto", functions, parallel=parallel)
    if choice == "required":
        return ToolPlan("required", functions, parallel=parallel)
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                                '{"type": "function", "function": {"name": ...}}', param="tool_choice")
        if name not in functions:
            raise APIError(400, f"tool_choice names the function {name!r}, which is not among the tools",
                           param="tool_choice")
        return ToolPlan("named", functions, name=name, parallel=parallel)
    raise APIError(400, f"tool_choice {choice!r} is not one of 'none', 'auto', 'required' or a named function",
                   param="tool_choice")


def template_message(role: str, content, name: str | None, extra: dict | None) -> dict:
    """A request message as the chat template sees it: assistant tool calls with their arguments as
    objects (templates write them with `tojson`), and a tool result's id and name."""
    msg = {"role": role, "content": content}
    extra = extra or {}
    calls = extra.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise APIError(400, "tool_calls must be a list", param="messages")
        converted = []
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise APIError(400, "each tool_calls entry needs function.name", param="messages")
            args = fn.get("arguments", "{}")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    raise APIError(400, f"tool call arguments are not JSON: {args[:100]!r}", param="messages") from None
            converted.append({**call, "function": {**fn, "arguments": args}})
        msg["tool_calls"] = converted
    if isinstance(extra.get("tool_call_id"), str):
        msg["tool_call_id"] = extra["tool_call_id"]
    if name is not None:
        msg["name"] = name
    return msg
