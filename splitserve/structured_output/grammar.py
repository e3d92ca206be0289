"""Output constraints as xgrammar grammars: one builder for the front's check and the core's compile.

A constraint is identified by its key (`StructuredOutputsParams.key()`: kind, canonical spec,
options). The front parses it into a grammar to turn an invalid schema, regex or EBNF grammar away
with the reason (a 400, or a ValueError offline); the check needs no tokenizer and is cached by key,
so a schema that many requests repeat is parsed once. The engine core compiles the same grammar
against the tokenizer's vocabulary (structured_output/manager.py), off its step loop.
"""
from __future__ import annotations

import json
import re
from functools import lru_cache

from splitserve.sampling_params import SamplingParamsError, StructuredOutputsParams

# xgrammar's messages start with a timestamp and a C++ source location: "[05:19:31] /project/cpp/
# regex_converter.cc:83: Regex parsing error ..."; the reason is what follows.
_LOCATION = re.compile(r"^\s*\[[\d:]+\]\s*\S+?:\d+:\s*")
_CHECK_FAILED = re.compile(r"^Check failed: \(.*?\) is false:\s*")


def error_reason(exc: BaseException) -> str:
    text = str(exc).strip()
    text = _CHECK_FAILED.sub("", _LOCATION.sub("", text))
    return " ".join(text.split()) or type(exc).__name__


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly the given strings. JSON string literals are valid
    EBNF literals for xgrammar (the same escapes), so quotes, backslashes and newlines need no care."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def build_grammar(key: tuple):
    """The xgrammar Grammar of a constraint key. Raises xgrammar's error on an invalid spec."""
    import xgrammar as xgr
    kind, spec, no_whitespace, _ = key
    if kind == "json":
        # strict_mode: objects carry only the properties the schema names (OpenAI's strict schemas,
        # and vLLM's disable_additional_properties), which also keeps a small model from wandering.
        return xgr.Grammar.from_json_schema(spec, any_whitespace=not no_whitespace, strict_mode=True)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=not no_whitespace,
                                            strict_mode=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(spec)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(spec)))
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(spec)
    raise ValueError(f"unknown structured output kind {kind!r}")


_FIELD = {"json": "json schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
          "grammar": "grammar"}


@lru_cache(maxsize=512)
def _check_key(key: tuple) -> str | None:
    try:
        build_grammar(key)
    except Exception as e:  # xgrammar raises RuntimeError (C++ checks) or ValueError
        return error_reason(e)
    return None


def check_structured_outputs(params: StructuredOutputsParams) -> tuple:
    """Raises ValueError naming the problem when the constraint cannot be compiled; returns its key."""
    key = params.key()  # raises for a json schema that is not JSON
    reason = _check_key(key)
    if reason is not None:
        raise SamplingParamsError("structured_outputs", f"structured_outputs: invalid {_FIELD[key[0]]}: {reason}")
    return key
