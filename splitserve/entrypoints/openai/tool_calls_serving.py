"""The chat handler's tool-call steps, kept out of serving.py: the output constraint for `required` /
named tool choices, the tools' schema check, and model text into `tool_calls` (whole or streamed).

Streamed calls follow OpenAI's delta format: per call a first piece with index, id, type and
function.name (arguments ""), then pieces of function.arguments text.
"""
from __future__ import annotations


from splitserve.entrypoints.openai.protocol import (APIError, ChatMessageOut, DeltaFunctionCall, DeltaMessage,
                                                    DeltaToolCall, FunctionCallOut, ToolCallOut)
from splitserve.entrypoints.openai.tool_choice import ToolPlan
from splitserve.entrypoints.openai.tool_parsers import (StreamingToolExtractor, ToolCall, get_tool_parser,
                                                        new_call_id)
from splitserve.sampling_params import SamplingParams, StructuredOutputsParams


def constrained(plan: ToolPlan | None) -> bool:
    return plan is not None and plan.mode in ("required", "named")


def reads_calls(plan: ToolPlan | None, parser: str | None) -> bool:
    """Whether the answer's text is read for tool calls."""
    return constrained(plan) or (plan is not None and plan.mode == "auto" and parser is not None)


def constrain(plan: ToolPlan | None, params: SamplingParams, parser: str | None) -> SamplingParams:
    if constrained(plan):
        if params.structured_outputs is not None:
            raise APIError(400, f"tool_choice {plan.mode!r} constrains the output itself; it cannot be combined "
                                f"with response_format or another structured output constraint", param="tool_choice")
        # Compact JSON: free whitespace only costs tokens (small models pad with runs of newlines).
        so = StructuredOutputsParams(json=plan.schema(), disable_any_whitespace=True)
        return params.replace_valid(structured_outputs=so)  # so was checked when built
    if reads_calls(plan, parser) and get_tool_parser(parser).needs_special_tokens:
        # The format's markers are special tokens: the text must keep them for the parser to see.
        return params.replace_valid(skip_special_tokens=False)
    return params


async def check_tools(serving, plan: ToolPlan | None) -> None:
    """Every tool's parameters schema must compile (checked off the event loop when large)."""
    if plan is None:
        return
    from splitserve.structured_output.grammar import check_structured_outputs
    for name, schema in plan.functions.items():
        try:
            await serving._off_loop(len(repr(schema)), check_structured_outputs, StructuredOutputsParams(json=schema))
        except ValueError as e:
            raise APIError(400, f"tools: function {name!r} has an invalid parameters schema: {e}",
                           param="tools") from None


def _calls_out(calls: list[ToolCall]) -> list[ToolCallOut]:
    return [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls]


def _finish(calls: list, finish: str | None) -> str | None:
    return "tool_calls" if calls and finish == "stop" else finish


def message_out(plan: ToolPlan | None, parser: str | None, text: str,
                finish: str | None) -> tuple[ChatMessageOut, str | None]:
    """The assistant message of a finished answer, and its finish_reason."""
    if not reads_calls(plan, parser):
        return ChatMessageOut(content=text), finish
    if constrained(plan):
        calls = plan.calls_from_constrained(text)
        if not calls:
            return ChatMessageOut(content=text), finish
        return ChatMessageOut(content=None, tool_calls=_calls_out(calls)), _finish(calls, finish)
    extracted = get_tool_parser(parser).extract(text)
    return (ChatMessageOut(content=extracted.content, tool_calls=_calls_out(extracted.calls)),
            _finish(extracted.calls, finish))


def _call_deltas(calls: list[ToolCall], first_index: int = 0) -> list[DeltaMessage]:
    out = []
    for i, c in enumerate(calls, first_index):
        out.append(DeltaMessage(tool_calls=[DeltaToolCall(index=i, id=c.id, type="function",
                                                          function=DeltaFunctionCall(name=c.name, arguments=""))]))
        out.append(DeltaMessage(tool_calls=[DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=c.arguments))]))
    return out


class ToolDeltas:
    """One streamed choice: its text deltas in, content and tool-call deltas out."""

    def __init__(self, plan: ToolPlan, parser: str | None):
        self.plan = plan
        self.text = ""
        self.header_sent = False
        self.extractor = None if constrained(plan) else StreamingToolExtractor(get_tool_parser(parser))

    def step(self, delta: str, finish: str | None) -> tuple[list[DeltaMessage], str | None]:
        self.text += delta
        if self.plan.mode == "named":  # the output is the arguments: stream them as they come
            out = []
            if not self.header_sent:
                self.header_sent = True
                out.append(DeltaMessage(tool_calls=[DeltaToolCall(
                    index=0, id=new_call_id(), type="function",
                    function=DeltaFunctionCall(name=self.plan.name, arguments=""))]))
            if delta:
                out.append(DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta))]))
            return out, _finish([1], finish)
        if self.plan.mode == "required":  # an array of calls: read it whole at the end
            if finish is None:
                return [], None
            calls = self.plan.calls_from_constrained(self.text)
            if not calls:
                return [DeltaMessage(content=self.text)], finish
            return _call_deltas(calls), _finish(calls, finish)
        out = []
        content = self.extractor.feed(delta)
        if content:
            out.append(DeltaMessage(content=content))
        if finish is not None:
            result = self.extractor.finish()
            if result.content:
                out.append(DeltaMessage(content=result.content))
            out.extend(_call_deltas(result.calls))
            finish = _finish(result.calls, finish)
        return out, finish
