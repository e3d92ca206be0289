"""Offline API: `LLM(model).generate(prompts, params)` and `LLM.chat(messages)`.

As in vLLM: without sampling params, requests take the model's generation-config defaults
(`get_default_sampling_params`); logprobs come as `{token_id: Logprob}` with `.logprob`, `.rank` and
`.decoded_token` (a Logprob is also the float itself).
"""
from __future__ import annotations

import time
from typing import Any, Sequence

from tqdm import tqdm

from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.output_processor import RequestOutput
from splitserve.engine.args import EngineArgs
from splitserve.sampling_params import SamplingParams

Prompt = str | list[int] | dict


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any):
        """`kwargs` are EngineArgs fields (the CLI's engine flags, with underscores); any other
        keyword is a TypeError that lists the valid ones."""
        from splitserve.engine.vllm_flags import find_unsupported_keywords
        unsupported = find_unsupported_keywords(kwargs, EngineArgs.__dataclass_fields__)
        if unsupported:
            raise TypeError(f"LLM(): {', '.join(unsupported)} {'is a vLLM option' if len(unsupported) == 1 else 'are vLLM options'} "
                            f"splitserve does not support")
        args = EngineArgs.from_kwargs("LLM()", model=model, **kwargs)
        if args.data_parallel_size > 1:  # engine cores in processes of their own, as the server's
            from splitserve.engine.replicated_llm_engine import ReplicatedLLMEngine
            self.engine = ReplicatedLLMEngine(args)
        else:
            self.engine = LLMEngine(args)
        self.tokenizer = self.engine.tokenizer

    def get_tokenizer(self):
        """The Hugging Face tokenizer requests are encoded with (its chat template included)."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request without sampling params runs with: the model's generation-config defaults
        (temperature, top_p, ...; `generation_config="vllm"` leaves SamplingParams' own)."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None, priority: list[int] | None = None) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in the order of the prompts. A prompt is
        text, a list of token ids, or {"prompt": ...} / {"prompt_token_ids": [...]}. `lora_request`: a
        LoRARequest for every prompt, or a list of one (or None) per prompt (needs enable_lora).
        `priority`: one per prompt, with scheduling_policy="priority" (lower runs first)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [self._unwrap(p) for p in prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        if isinstance(lora_request, (list, tuple)):
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
        else:
            loras = [lora_request] * len(prompts)
        # Validate everything before queueing anything, so a bad prompt leaves no work behind.
        tokenized = [self.engine.tokenize_prompt(p, sp) for p, sp in zip(prompts, params)]
        for ids, sp, prio in zip(tokenized, params, priorities):
            self.engine.validate(ids, sp)
            self.engine.front.check_priority(prio)
        for lora in {id(x): x for x in loras if x is not None}.values():
            self.engine.front.loras.check(lora)
        ids = [self.engine.add_request(None, p, sp, stream=False, lora_request=lr, priority=prio)
               for p, sp, lr, prio in zip(prompts, params, loras, priorities)]
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, chat_template: str | None = None,
             tools: list[dict] | None = None, **template_kwargs: Any) -> list[RequestOutput]:
        """`chat_template`: a Jinja template (text) to use instead of the tokenizer's. `tools`: OpenAI
        tool definitions, given to the template (which decides how the model sees them); the calls are
        not parsed out of the answers here."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if chat_template is not None:
            template_kwargs["chat_template"] = chat_template
        if tools:
            template_kwargs["tools"] = tools
        from splitserve.multimodal.processor import offline_chat_prompt  # handles image content parts
        prompts = [offline_chat_prompt(self, c, add_generation_prompt, **template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None) and not kwargs.get("chat_template"):
            raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 tokenize=True, **kwargs)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def _decode_logprobs(self, out: RequestOutput) -> None:
        """Fills each Logprob's decoded_token (the token's own text, special tokens included), of the
        output's logprobs and the prompt's."""
        cache: dict[int, str] = {}
        entries = [e for o in out.outputs for e in o.logprobs or ()] + [e for e in out.prompt_logprobs or () if e]
        for entry in entries:
            for token, lp in entry.items():
                if token not in cache:
                    cache[token] = self.tokenizer.decode([token], skip_special_tokens=False)
                lp.decoded_token = cache[token]

    def _unwrap(self, prompt: Prompt) -> str | list[int]:
        if isinstance(prompt, dict):
            if prompt.get("multi_modal_data"):
                from splitserve.multimodal.processor import offline_prompt
                return offline_prompt(self.engine, prompt)
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"])
            return prompt["prompt"]
        return prompt

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm or len(ids) < 2)
        start, tokens_in, tokens_out = time.perf_counter(), 0, 0
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        self._decode_logprobs(out)
                        tokens_in += len(out.prompt_token_ids) + out.num_encoder_tokens
                        tokens_out += sum(len(o.token_ids) for o in out.outputs)
                        if not bar.disable:
                            elapsed = max(time.perf_counter() - start, 1e-9)
                            bar.set_postfix_str(f"input {tokens_in / elapsed:.1f} tok/s, "
                                                f"output {tokens_out / elapsed:.1f} tok/s", refresh=False)
                        bar.update(1)
        finally:
            bar.close()
            unfinished = [i for i in ids if i not in results]
            if unfinished:  # interrupted: leave the engine clean
                self.engine.abort_request(unfinished)
        return [results[i] for i in ids]
