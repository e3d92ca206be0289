"""Request and response bodies of the OpenAI-compatible API (pydantic v2).

Requests accept the OpenAI fields plus the sampling extensions vLLM accepts (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, allowed_token_ids, bad_words, ...).
Structured outputs come as OpenAI's `response_format` (json_object, json_schema), as vLLM's
`structured_outputs` object, or as its older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` fields; one request may use one of them. Unknown fields are ignored, as
OpenAI clients send fields that a server may not know. Types are checked here; ranges are checked by
SamplingParams, whose errors (SamplingParamsError) carry the field, so there is one source of truth for
what is valid.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_serializer
from pydantic.types import FailFast

from splitserve.loading.generation_config import apply_defaults
from splitserve.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError, StructuredOutputsParams

# n fans a request out into n sequences; a cap keeps one request from flooding the engine.
MAX_N = 128
_INT64 = 2 ** 63
_TOP_K_CAP = 2 ** 31 - 1


class _FailFast(FailFast):
    __hash__ = object.__hash__  # typing.Union hashes its members; pydantic's FailFast is unhashable


_FAIL_FAST = _FailFast()
# Each list member stops at its first wrong element. Without that, pydantic's smart union checks a
# prompt of a million token ids against list[str] first and builds a million errors before list[int]
# matches: ~1 s of the event loop per 2 MB of body. Same members, same results, same schema.
PromptField = Union[str, Annotated[list[str], _FAIL_FAST], Annotated[list[int], _FAIL_FAST],
                    Annotated[list[list[int]], _FAIL_FAST]]


class APIError(Exception):
    """An error that becomes an OpenAI-shaped JSON response."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def _require_valid_unicode(value: Any) -> None:
    """JSON may escape a lone UTF-16 surrogate ("\\ud800"); Python then holds a str that cannot be
    encoded, and the tokenizer, the chat template or the response writer fail on it later, deep
    inside. Refuse it at the door, in every string of a request, nested ones included."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("contains an unpaired surrogate escape (\\ud800-\\udfff): not valid "
                                 "Unicode") from None
    elif isinstance(value, (list, tuple)):
        for v in value:
            if not isinstance(v, int):  # token-id prompts are long lists of ints: skip them cheaply
                _require_valid_unicode(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            _require_valid_unicode(k)
            _require_valid_unicode(v)


class _Request(BaseModel):
    # NaN/inf would slip past every range check (all comparisons are false), so refuse them here.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        _require_valid_unicode(value)
        return value


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # with include_usage: usage so far in every chunk (vLLM's)


class _SamplingRequest(_Request):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(default=None, ge=-_INT64, lt=_INT64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    user: str | None = None  # accepted, as OpenAI's; not used
    # vLLM's extensions: lower runs first (--scheduling-policy priority); keep the last k prompt
    # tokens; per prompt token its logprob and the top k (not with stream).
    priority: int = Field(default=0, ge=-_INT64, lt=_INT64)
    # vLLM's prefill/decode protocol: {"do_remote_decode": true} asks a KV producer to hold the
    # prompt's blocks (its response carries the params a decode engine needs); {"do_remote_prefill":
    # true, "remote_engine_id", "remote_host", "remote_port", "remote_block_ids", "remote_request_id"}
    # asks a KV consumer to load them instead of prefilling.
    kv_transfer_params: dict | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-_INT64, lt=_INT64)
    prompt_logprobs: int | None = Field(default=None, ge=-_INT64, lt=_INT64)
    # Structured outputs (see the module's docstring).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # vLLM's; xgrammar is the one backend
    # The field the constraint came from, for the `param` of an error found later (an invalid schema).
    _constraint_field: str = PrivateAttr(default="structured_outputs")

    @property
    def constraint_field(self) -> str:
        return self._constraint_field

    def _check_common(self) -> None:
        if self.n > MAX_N:
            raise APIError(400, f"n must be <= {MAX_N}, got {self.n}", param="n")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise APIError(400, "prompt_logprobs are not available when stream is true", param="prompt_logprobs")

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The request's output constraint, from whichever of its fields names one (at most one)."""
        sources: list[tuple[str, dict]] = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                sources.append(("response_format", {"json_object": True}))
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                if not isinstance(spec, dict):
                    raise APIError(400, "response_format of type json_schema needs a json_schema object",
                                   param="response_format")
                schema = spec.get("schema")
                if schema is None:  # OpenAI allows a schema-less json_schema: any JSON object
                    sources.append(("response_format", {"json_object": True}))
                elif not isinstance(schema, dict):
                    raise APIError(400, "response_format.json_schema.schema must be a JSON object",
                                   param="response_format")
                else:
                    sources.append(("response_format", {"json": schema}))
            elif kind not in (None, "text"):
                raise APIError(400, f"response_format type {kind!r} is not supported (text, json_object, "
                                    f"json_schema)", param="response_format")
        if self.structured_outputs is not None:
            so = {k: v for k, v in self.structured_outputs.items() if v is not None}
            so.pop("backend", None)
            so.pop("disable_fallback", None)
            sources.append(("structured_outputs", so))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                sources.append((name, {key: value}))
        if len(sources) > 1:
            names = ", ".join(n for n, _ in sources)
            raise APIError(400, f"give one structured output constraint, got several: {names}", param=sources[1][0])
        if self.guided_whitespace_pattern is not None:
            raise APIError(400, "guided_whitespace_pattern is not supported", param="guided_whitespace_pattern")
        if not sources:
            return None
        param, fields = sources[0]
        self._constraint_field = param
        known = set(StructuredOutputsParams.__dataclass_fields__)
        unknown = sorted(set(fields) - known)
        if unknown:
            raise APIError(400, f"unknown structured_outputs fields: {', '.join(unknown)}", param=param)
        try:
            return StructuredOutputsParams(**fields)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param=param) from None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         defaults: dict | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
        def pick(value, default):
            return default if value is None else value

        # What the request leaves unset comes from the model's generation config (when the server
        # has one), then from SamplingParams' own defaults.
        if self.kv_transfer_params is not None and self.n != 1:
            raise APIError(400, "kv_transfer_params (prefill/decode disaggregation) need n=1", param="kv_transfer_params")
        given = apply_defaults(defaults or {}, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                               min_p=self.min_p, repetition_penalty=self.repetition_penalty, max_tokens=max_tokens)
        try:
            return SamplingParams(
                n=self.n, temperature=given.get("temperature", 1.0), top_p=given.get("top_p", 1.0),
                # The sampler caps top_k at the vocabulary; capping here keeps it a machine int.
                top_k=min(given.get("top_k", 0), _TOP_K_CAP), min_p=given.get("min_p", 0.0),
                presence_penalty=pick(self.presence_penalty, 0.0),
                frequency_penalty=pick(self.frequency_penalty, 0.0),
                repetition_penalty=given.get("repetition_penalty", 1.0), seed=self.seed, stop=self.stop,
                stop_token_ids=self.stop_token_ids, max_tokens=given.get("max_tokens"), min_tokens=self.min_tokens,
                ignore_eos=self.ignore_eos, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output, logit_bias=self.logit_bias,
                allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
                prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
                truncate_prompt_tokens=self.truncate_prompt_tokens, structured_outputs=self._structured_outputs(),
                extra_args={"kv_transfer_params": self.kv_transfer_params} if self.kv_transfer_params else None)
        except SamplingParamsError as e:  # every check of SamplingParams names its field
            raise APIError(400, str(e), param=e.param) from None
        except ValueError as e:  # not expected: a 400 that names no field rather than a 500
            raise APIError(400, str(e)) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage so far in every streamed chunk (vLLM's stream_options.continuous_usage_stats, which
        counts only together with include_usage)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingRequest):
    prompt: PromptField
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def to_sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        self._check_common()
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported", param="best_of")
        # echo with logprobs returns the prompt tokens' logprobs too (as vLLM: k = logprobs).
        prompt_logprobs = self.logprobs if self.echo and self.prompt_logprobs is None else None
        return self._sampling_params(self.max_tokens, self.logprobs, defaults, prompt_logprobs)

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (a batch), each text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class ContentPart(_Request):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    type: str
    text: str | None = None


class ChatMessage(_Request):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # checked by tool_choice.plan_tools
    parallel_tool_calls: bool | None = True

    def to_sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        self._check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                           param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, defaults)


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


# -- responses --------------------------------------------------------------------------------------
def _now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One token of prompt_logprobs, as vLLM writes its Logprob."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]


class GroundingEntity(BaseModel):
    phrase: str
    span: list[int]            # [start, end) in Grounding.text
    boxes: list[list[float]]   # (x0, y0, x1, y1), fractions of the image


class Grounding(BaseModel):
    """Kosmos-2: the generated text as transformers post-processes it (location tokens removed)
    and the phrases it grounded, with their boxes. Present only for such models."""
    text: str
    entities: list[GroundingEntity]


def _drop_null_grounding(handler, obj):
    """Model-specific fields (Kosmos-2's grounding, Nougat's markdown) appear only where set."""
    out = handler(obj)
    for name in ("grounding", "markdown"):
        if out.get(name, 0) is None:
            out.pop(name)
    return out


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    grounding: Grounding | None = None
    markdown: str | None = None  # Nougat: the text after transformers' markdown post-processing

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return _drop_null_grounding(handler, self)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    kv_transfer_params: dict | None = None  # a KV producer's answer for the decode engine (vLLM's)


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)  # OpenAI sends [] when there are none


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    """One streamed piece of a tool call: id, type and name in the first, argument text after."""
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    grounding: Grounding | None = None
    markdown: str | None = None  # Nougat: the text after transformers' markdown post-processing

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return _drop_null_grounding(handler, self)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, for the whole request
    kv_transfer_params: dict | None = None  # a KV producer's answer for the decode engine (vLLM's)


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        # OpenAI deltas carry only what changed: {"role": ...} first, then {"content": ...}, then {}.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "splitserve"
    root: str | None = None
    max_model_len: int | None = None
    quantization: str | None = None  # which quantization runs (vLLM's name first), None for float weights
    parent: str | None = None  # a LoRA adapter's base model (None for the base model itself)


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body of POST /v1/load_lora_adapter and /v1/unload_lora_adapter."""
    lora_name: str
    lora_path: str | None = None
    lora_int_id: int | None = None  # accepted as vLLM does; ids are the server's own


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
