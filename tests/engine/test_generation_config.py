"""Sampling defaults from generation_config.json (vLLM's rules), and how requests take them. CPU, no model."""
from __future__ import annotations

import json

import pytest

from splitserve.entrypoints.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest
from splitserve.loading.generation_config import apply_defaults, sampling_defaults

QWEN_LIKE = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
             "bos_token_id": 1, "eos_token_id": [2, 3], "transformers_version": "4.45.0"}


def model_dir(tmp_path, config: dict | None, name: str = "model"):
    d = tmp_path / name
    d.mkdir()
    if config is not None:
        (d / "generation_config.json").write_text(json.dumps(config))
    return str(d)


def test_auto_reads_the_sampling_fields_of_the_models_file(tmp_path):
    d = model_dir(tmp_path, {**QWEN_LIKE, "min_p": 0.05, "max_new_tokens": 300})
    assert sampling_defaults("auto", d) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                            "repetition_penalty": 1.05, "min_p": 0.05, "max_tokens": 300}


def test_vllm_mode_and_files_without_recommendations_give_nothing(tmp_path):
    d = model_dir(tmp_path, QWEN_LIKE)
    assert sampling_defaults("vllm", d) == {}
    assert sampling_defaults("auto", model_dir(tmp_path, None, "none")) == {}
    assert sampling_defaults("auto", d, is_gguf=True) == {}  # a GGUF file carries no generation config
    # transformers' own defaults are not recommendations (vLLM drops them the same way)
    plain = model_dir(tmp_path, {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0,
                                 "bos_token_id": 1}, "plain")
    assert sampling_defaults("auto", plain) == {}


def test_a_directory_replaces_the_models_file(tmp_path):
    d = model_dir(tmp_path, QWEN_LIKE)
    other = model_dir(tmp_path, {"temperature": 0.0}, "other")
    assert sampling_defaults(other, d) == {"temperature": 0.0}
    with pytest.raises(ValueError, match="must be auto, vllm or a directory"):
        sampling_defaults(str(tmp_path / "missing"), d)
    with pytest.raises(ValueError, match="has no generation_config.json"):
        sampling_defaults(model_dir(tmp_path, None, "empty"), d)


def test_override(tmp_path):
    d = model_dir(tmp_path, QWEN_LIKE)
    got = sampling_defaults("auto", d, override='{"temperature": 0.2, "max_new_tokens": 64}')
    assert got == {"temperature": 0.2, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 64}
    assert sampling_defaults("vllm", d, override={"top_p": 0.5}) == {"top_p": 0.5}
    with pytest.raises(ValueError, match="unknown field 'temprature'"):
        sampling_defaults("auto", d, override='{"temprature": 0.2}')
    with pytest.raises(ValueError, match="not valid JSON"):
        sampling_defaults("auto", d, override="{temperature: 0.2}")
    with pytest.raises(ValueError, match="top_k must be a number"):
        sampling_defaults("auto", d, override='{"top_k": 2.5}')


def test_bad_files_are_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read the generation config"):
        bad = tmp_path / "bad"
        bad.mkdir()
        (bad / "generation_config.json").write_text("{not json")
        sampling_defaults("auto", str(bad))
    with pytest.raises(ValueError, match="temperature must be a number"):
        sampling_defaults("auto", model_dir(tmp_path, {"temperature": "hot"}, "str"))


def test_apply_defaults_fills_unset_fields_and_caps_max_tokens():
    defaults = {"temperature": 0.7, "top_k": 20, "max_tokens": 100}
    assert apply_defaults(defaults, temperature=None, top_k=None, top_p=None, max_tokens=None) == \
        {"temperature": 0.7, "top_k": 20, "max_tokens": 100}
    assert apply_defaults(defaults, temperature=0.0, top_k=5, top_p=0.9, max_tokens=500) == \
        {"temperature": 0.0, "top_k": 5, "top_p": 0.9, "max_tokens": 100}  # max_tokens: a ceiling
    assert apply_defaults(defaults, max_tokens=10)["max_tokens"] == 10
    assert apply_defaults({}, temperature=None, max_tokens=None) == {}


def test_requests_take_the_defaults_and_override_them():
    defaults = {"temperature": 0.0, "top_p": 0.8, "top_k": 20, "min_p": 0.1, "repetition_penalty": 1.1,
                "max_tokens": 50}
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    p = chat.to_sampling_params(defaults)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (0.0, 0.8, 20, 0.1, 1.1, 50)
    assert chat.to_sampling_params().temperature == 1.0 and chat.to_sampling_params().max_tokens is None
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=0.9, top_k=-1,
                                 max_completion_tokens=10)
    p = chat.to_sampling_params(defaults)
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (0.9, 0, 0.8, 10)
    comp = CompletionRequest(prompt="x")  # completions default to 16 tokens, under the ceiling
    assert comp.to_sampling_params(defaults).max_tokens == 16
    assert CompletionRequest(prompt="x", max_tokens=200).to_sampling_params(defaults).max_tokens == 50
    with pytest.raises(APIError, match="temperature must be >= 0"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=-1).to_sampling_params(defaults)
