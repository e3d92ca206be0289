"""Sampling defaults from a model's generation_config.json, as vLLM applies them.

Model makers ship recommended sampling settings (Qwen: temperature 0.7, top_p 0.8, top_k 20, ...);
vLLM uses them for every field a request leaves unset, unless started with `--generation-config vllm`.
The fields taken, and their names in SamplingParams:

    temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens -> max_tokens

max_tokens from the file is a ceiling, not a default: vLLM caps every request's max_tokens at it.
Like vLLM (which reads the file through transformers' `GenerationConfig.to_diff_dict`), a value equal
to transformers' own default is not a recommendation and is dropped: top_k 50 in particular, which
many files carry only because transformers writes it, does not turn top-k sampling on.
"""
from __future__ import annotations

import json
import os
from typing import Any

# generation_config.json key -> SamplingParams field
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# transformers' GenerationConfig defaults: a file that repeats them recommends nothing.
_TRANSFORMERS_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def _read(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the generation config {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"the generation config {path} is not a JSON object")
    return data


def _check_value(field: str, value: Any, where: str) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if field in ("top_k", "max_tokens"):
        ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok:
        raise ValueError(f"{where}: {field} must be a number, got {value!r}")


def sampling_defaults(mode: str, model_dir: str | None, is_gguf: bool = False,
                      override: str | dict | None = None) -> dict[str, Any]:
    """The SamplingParams fields a request that does not set them takes from the model's generation
    config. mode: "auto" (the model directory's file; a GGUF file has none), "vllm" (nothing), or a
    directory holding a generation_config.json. `override` (a JSON object, as text or a dict)
    replaces or adds fields, in SamplingParams' names (max_new_tokens is accepted too)."""
    defaults: dict[str, Any] = {}
    if mode == "auto":
        path = None if (is_gguf or model_dir is None) else os.path.join(model_dir, "generation_config.json")
        if path is not None and os.path.exists(path):
            defaults = _from_file(path)
    elif mode != "vllm":
        if not os.path.isdir(mode):
            raise ValueError(f"--generation-config must be auto, vllm or a directory, got {mode!r}")
        path = os.path.join(mode, "generation_config.json")
        if not os.path.exists(path):
            raise ValueError(f"--generation-config {mode}: the directory has no generation_config.json")
        defaults = _from_file(path)
    if override:
        if isinstance(override, str):
            try:
                override = json.loads(override)
            except ValueError as e:
                raise ValueError(f"--override-generation-config is not valid JSON: {e}") from None
        if not isinstance(override, dict):
            raise ValueError("--override-generation-config must be a JSON object")
        for key, value in override.items():
            field = _FIELDS.get(key, key)
            if field not in _FIELDS.values():
                raise ValueError(f"--override-generation-config: unknown field {key!r}; known: "
                                 f"{', '.join(sorted(_FIELDS))}")
            _check_value(field, value, "--override-generation-config")
            defaults[field] = value
    return defaults


def _from_file(path: str) -> dict[str, Any]:
    data = _read(path)
    out = {}
    for key, field in _FIELDS.items():
        value = data.get(key)
        if value is None or (key in _TRANSFORMERS_DEFAULTS and value == _TRANSFORMERS_DEFAULTS[key]):
            continue
        _check_value(field, value, path)
        out[field] = value
    return out


def apply_defaults(defaults: dict[str, Any], **given: Any) -> dict[str, Any]:
    """SamplingParams keywords: each field a request left None takes the default, and max_tokens is
    capped by the default's (vLLM's rule). Fields that neither set are left out."""
    out = {k: v for k, v in given.items() if v is not None}
    for field, value in defaults.items():
        if field == "max_tokens":
            mine = given.get("max_tokens")
            out["max_tokens"] = value if mine is None else min(mine, value)
        elif given.get(field) is None:
            out[field] = value
    return out
