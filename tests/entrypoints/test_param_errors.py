"""A 400's `param` comes from the failing check's field (SamplingParamsError.param), for the checks of
SamplingParams (at construction, in the OpenAI layer) and of the engine's front (in serving._add). The
expected status, message and param are what the code returned while it still parsed them out of the
message: clients see the same errors."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from splitserve.engine.async_engine import AsyncLLMEngine
from splitserve.entrypoints.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest
from splitserve.entrypoints.openai.serving import OpenAIServing
from splitserve.sampling_params import SamplingParams, SamplingParamsError
from tests.engine.test_async_engine import FakeCore, FakeFront


@pytest.mark.parametrize("fields,message,param", [
    ({"temperature": -1}, "temperature must be >= 0, got -1.0", "temperature"),
    ({"top_p": 0}, "top_p must be in (0, 1], got 0.0", "top_p"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0", "max_tokens"),
    ({"logprobs": 21}, "logprobs must be an integer in [0, 20], got 21", "logprobs"),
    ({"n": 0}, "n must be an integer >= 1, got 0", "n"),
    ({"min_tokens": 5, "max_tokens": 3}, "min_tokens must be <= max_tokens, got min_tokens=5, max_tokens=3",
     "min_tokens"),
    ({"stop": [""]}, "stop must be non-empty strings, got ['']", "stop"),
    ({"logit_bias": {"x": 1}}, "logit_bias keys must be token ids, got 'x'", "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list of non-negative token ids, got []",
     "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words must be a list of non-empty strings, got ['']", "bad_words"),
    ({"prompt_logprobs": 21}, "prompt_logprobs must be an integer in [0, 20], got 21", "prompt_logprobs"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex must be a non-empty string",
     "structured_outputs"),
])
def test_completion_field_errors(fields, message, param):
    with pytest.raises(APIError) as info:
        CompletionRequest(prompt="hi", **fields).to_sampling_params()
    assert (info.value.status, info.value.message, info.value.param) == (400, message, param)


def test_chat_max_completion_tokens_is_reported_as_max_tokens():
    with pytest.raises(APIError) as info:
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_completion_tokens=0).to_sampling_params()
    assert (info.value.status, info.value.param) == (400, "max_tokens")


def _serving(core: FakeCore) -> tuple[OpenAIServing, FakeFront, AsyncLLMEngine]:
    front = FakeFront(core.max_running)
    front.world_size, front.loras = 2, None
    front.config.scheduler.policy = "fcfs"
    engine = AsyncLLMEngine(SimpleNamespace(core=core, front=front), max_queued_requests=4)
    serving = OpenAIServing.__new__(OpenAIServing)  # only what _add reads
    serving.engine, serving.max_model_len, serving.log_requests, serving.on_lora_request = engine, 10_000, False, None
    serving.metrics = None
    return serving, front, engine


def test_front_errors_name_their_field():
    cases = [
        (SamplingParams(logit_bias={5000: 1}), [1, 2], 0, 10_000,
         "logit_bias holds token ids outside the vocabulary [0, 1000): [5000]", "logit_bias"),
        (SamplingParams(allowed_token_ids=[5000]), [1, 2], 0, 10_000,
         "allowed_token_ids holds token ids outside the vocabulary [0, 1000): [5000]", "allowed_token_ids"),
        (SamplingParams(), [1, 2], 3, 10_000, "priority 3 needs the priority scheduling policy "
         "(--scheduling-policy priority); this engine runs fcfs", "priority"),
        (SamplingParams(truncate_prompt_tokens=20000), [1, 2], 0, 10_000, "truncate_prompt_tokens (20000) is greater "
         "than max_model_len (10000); choose a smaller truncation size", "truncate_prompt_tokens"),
        (SamplingParams(max_tokens=9999), [1, 2], 0, 10_000, "prompt (2 tokens) + max_tokens (9999) = 10001 tokens "
         "exceeds the model's context of 10000 tokens", "max_tokens"),
        (SamplingParams(max_tokens=60), [1] * 50, 0, 100,
         "request needs 110 tokens of KV cache, but the cache holds only 100 tokens", "prompt"),
        (SamplingParams(prompt_logprobs=1), [1, 2], 0, 10_000,
         "prompt_logprobs is not supported yet with several ranks (world size 2)", "prompt_logprobs"),
        (SamplingParams(n=50), [1, 2], 0, 10_000, "n must be <= 12 on this server (--max-queued-requests 4 + "
         "--max-num-seqs 8), got 50", "n"),
        (SamplingParams(), [5000], 0, 10_000, "prompt token ids must be integers in [0, 1000), got [5000]", "prompt"),
    ]

    async def main():
        serving, front, engine = _serving(FakeCore())
        got = []
        try:  # shut down even when a case fails: a live engine left to the collector can block it
            for i, (params, prompt, priority, kv, _, _) in enumerate(cases):
                front.kv_capacity_tokens = kv
                with pytest.raises(APIError) as info:
                    serving._add(f"r{i}", prompt, params, "prompt", priority=priority)
                got.append((info.value.status, info.value.message, info.value.param))
        finally:
            await engine.shutdown()
        return got

    assert asyncio.run(main()) == [(400, message, param) for *_, message, param in cases]


def test_param_is_taken_from_the_error_not_its_text():
    """An error whose message does not start with its field still reports the field."""
    async def main():
        serving, front, engine = _serving(FakeCore())

        def refuse(*args, **kwargs):
            raise SamplingParamsError("top_p", "the nucleus is too small for this model")
        front.new_request = refuse
        try:
            with pytest.raises(APIError) as info:
                serving._add("r", [1, 2], SamplingParams(), "messages")
        finally:
            await engine.shutdown()
        return info.value

    err = asyncio.run(main())
    assert (err.status, err.message, err.param) == (400, "the nucleus is too small for this model", "top_p")


def test_kv_transfer_params_reach_the_engine_as_vllm_passes_them():
    params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}
    sp = CompletionRequest(prompt="hi", max_tokens=1, kv_transfer_params=params).to_sampling_params()
    assert sp.extra_args == {"kv_transfer_params": params}
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], kv_transfer_params=params)
    assert chat.to_sampling_params().extra_args["kv_transfer_params"] == params
    assert CompletionRequest(prompt="hi").to_sampling_params().extra_args is None
    with pytest.raises(APIError, match="need n=1"):
        CompletionRequest(prompt="hi", n=2, kv_transfer_params=params).to_sampling_params()
