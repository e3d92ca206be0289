"""User-facing sampling options, validated on construction.

Names follow vLLM's: `SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))`,
`logit_bias`, `allowed_token_ids`, `bad_words`. What can be checked without a tokenizer is checked
here; whether a schema, regex or grammar compiles is checked by the engine's front
(structured_output/grammar.py), which also turns `bad_words` into token ids (carried beside the
params, in EngineCoreRequest.bad_words_token_ids: what the front derives is not the user's).
"""
from __future__ import annotations

import copy
import functools
import json as _json
import math
from dataclasses import dataclass

_GREEDY_EPS = 1e-5
# OpenAI's range for logit_bias values: -100 bans a token, +100 forces it.
LOGIT_BIAS_LIMIT = 100.0
# Most top logprobs a token may ask for (vLLM's default max_logprobs), sampled and prompt tokens alike.
MAX_LOGPROBS = 20


class SamplingParamsError(ValueError):
    """A request parameter is invalid; `param` names it (the OpenAI error's `param`), so callers
    map the error to its field as data instead of reading the field back out of the message."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # pickles with both arguments (ValueError's default keeps only args)
        return type(self), (self.param, str(self))


def _validated_on_init(cls):
    """Runs `cls._check()` (normalize and validate) after the dataclass's generated __init__, not in
    __post_init__: msgspec decodes a dataclass without calling __init__ (it sets the fields and calls
    only __post_init__), so params validated once where they are built, in the engine's front, cross
    the seams to the core and the worker without being checked again. Construction, and
    dataclasses.replace (which calls __init__), still validate."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._check()

    cls.__init__ = __init__
    return cls


@_validated_on_init
@dataclass
class StructuredOutputsParams:
    """One output constraint (exactly one of json, regex, choice, grammar, json_object)."""
    json: str | dict | None = None      # a JSON schema (an object or its text)
    regex: str | None = None
    choice: list[str] | None = None     # the output is exactly one of these strings
    grammar: str | None = None          # EBNF (GBNF-style: `root ::= ...`)
    json_object: bool | None = None     # any JSON object
    # JSON only: no free whitespace between tokens (compact output, no runaway newlines).
    disable_any_whitespace: bool = False
    # JSON schema only: objects may not hold properties the schema does not list.
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None  # vLLM's; not supported by the xgrammar backend
    structural_tag: str | None = None      # vLLM's; not supported

    def _check(self) -> None:
        def bad(message: str) -> None:
            raise SamplingParamsError("structured_outputs", message)

        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            bad("structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object; got {given or 'none'}")
        if self.whitespace_pattern is not None:
            bad("structured_outputs.whitespace_pattern is not supported (use disable_any_whitespace)")
        if self.structural_tag is not None:
            bad("structured_outputs.structural_tag is not supported")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            bad(f"structured_outputs.json must be a JSON schema (an object or its text), "
                f"got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                bad(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or any(not isinstance(c, str) or not c for c in self.choice)):
                bad("structured_outputs.choice must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        for k in ("json", "regex", "choice", "grammar"):
            if getattr(self, k) is not None:
                return k
        return "json_object"

    def key(self) -> tuple:
        """What the compiled grammar depends on: (kind, canonical spec, options). Equal keys share
        one compilation."""
        kind = self.kind
        if kind == "json":
            spec = self.json
            if isinstance(spec, str):
                try:
                    spec = _json.loads(spec)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            spec = _json.dumps(spec, sort_keys=True, separators=(",", ":"))
        elif kind == "choice":
            spec = _json.dumps(self.choice, ensure_ascii=False)
        elif kind == "json_object":
            spec = ""
        else:
            spec = getattr(self, kind)
        json_like = kind in ("json", "json_object")
        return (kind, spec, json_like and self.disable_any_whitespace,
                kind == "json" and self.disable_additional_properties)


@_validated_on_init
@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (0: only the sampled one)
    # Per prompt token after the first: its logprob given the tokens before it, plus the top k.
    prompt_logprobs: int | None = None
    # Keep only the last k prompt tokens (-1: the model's context); applied by the engine's front.
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # {token id: bias added to its logit}, values in [-100, 100] (-100 bans, +100 forces)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None          # never generated (as whole token sequences)
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's free-form extras; "kv_transfer_params" (prefill/decode disaggregation) is read by the
    # engine core (core/scheduler.py), as vLLM's server passes it.
    extra_args: dict | None = None

    def _check(self) -> None:
        """Normalizes and validates, once, on construction (see _validated_on_init)."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.logit_bias is not None:
            self.logit_bias = self._normalize_logit_bias(self.logit_bias)
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or any(not isinstance(w, str) or not w for w in self.bad_words):
                raise SamplingParamsError("bad_words",
                                          f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
            self.bad_words = list(self.bad_words)
        self._validate()

    @staticmethod
    def _normalize_logit_bias(bias) -> dict[int, float]:
        """Keys may be ints or their decimal text (OpenAI's JSON has string keys)."""
        def bad(message: str) -> SamplingParamsError:
            return SamplingParamsError("logit_bias", message)

        if not isinstance(bias, dict):
            raise bad(f"logit_bias must be a map of token id to bias, got {type(bias).__name__}")
        out = {}
        for k, v in bias.items():
            try:
                tid = k if isinstance(k, int) and not isinstance(k, bool) else int(str(k).strip(), 10)
            except ValueError:
                raise bad(f"logit_bias keys must be token ids, got {k!r}") from None
            if tid < 0:
                raise bad(f"logit_bias keys must be non-negative token ids, got {k!r}")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or abs(v) > LOGIT_BIAS_LIMIT:
                raise bad(f"logit_bias values must be numbers in [-100, 100], got {v!r} for token {k}")
            out[tid] = float(v)
        return out

    def _validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise SamplingParamsError(name, f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "must be -1, 0 (off) or a positive integer")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be > 0")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "must be an integer")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError("min_tokens", f"min_tokens must be <= max_tokens, got "
                                      f"min_tokens={self.min_tokens}, max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 <= value <= MAX_LOGPROBS):
                bad(name, f"must be an integer in [0, {MAX_LOGPROBS}]")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or (k < 1 and k != -1)):
            bad("truncate_prompt_tokens", "must be -1 (the model's context) or an integer >= 1")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids
                or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed_token_ids)):
            bad("allowed_token_ids", "must be a non-empty list of non-negative token ids")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "must be a StructuredOutputsParams")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def allows_speculation(self) -> bool:
        """Whether drafts may be verified for this request: its logits do not depend on earlier
        tokens on the host (penalties, bad words). A grammar's request may: its drafts are checked
        by its grammar and each verify row gets the grammar's mask after the drafts before it."""
        return not (self.needs_penalties or self.bad_words)

    def replace_valid(self, **changes) -> "SamplingParams":
        """A copy with `changes`, not validated again: only for changes that keep valid params valid
        (a child's n and seed, stop ids dropped, a constraint built and checked on its own). The copy
        is shallow: params are read, never changed in place, once built. dataclasses.replace
        validates."""
        out = copy.copy(self)
        for name, value in changes.items():
            if name not in self.__dataclass_fields__:
                raise TypeError(f"SamplingParams has no field {name!r}")
            setattr(out, name, value)
        return out

    def for_child(self, index: int) -> "SamplingParams":
        """Params of the index-th of n parallel samples: n=1, and a distinct derived seed (the
        parent was validated; neither change can make it invalid)."""
        return self.replace_valid(n=1, seed=None if self.seed is None else self.seed + index)
