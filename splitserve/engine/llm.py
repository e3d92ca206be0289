"""Offline API: `LLM(model).generate(prompts, params)` and `LLM.chat(messages)`."""
from __future__ import annotations

from typing import Any, Sequence

from tqdm import tqdm

from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.output_processor import RequestOutput
from splitserve.engine_args import EngineArgs
from splitserve.sampling_params import SamplingParams

Prompt = str | list[int] | dict


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any):
        """`kwargs` are EngineArgs fields (the CLI's engine flags, with underscores); any other
        keyword is a TypeError that lists the valid ones."""
        self.engine = LLMEngine(EngineArgs.from_kwargs("LLM()", model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in the order of the prompts. A prompt is
        text, a list of token ids, or {"prompt": ...} / {"prompt_token_ids": [...]}."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [self._unwrap(p) for p in prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        # Validate everything before queueing anything, so a bad prompt leaves no work behind.
        tokenized = [self.engine.tokenize_prompt(p) for p in prompts]
        for ids, sp in zip(tokenized, params):
            self.engine.validate(ids, sp)
        ids = [self.engine.add_request(None, p, sp, stream=False) for p, sp in zip(prompts, params)]
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, **template_kwargs: Any) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        from splitserve.multimodal.processor import offline_chat_prompt  # handles image content parts
        prompts = [offline_chat_prompt(self, c, add_generation_prompt, **template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 tokenize=True, **kwargs)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

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
        bar = tqdm(total=len(ids), desc="generating", disable=not use_tqdm or len(ids) < 2)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            unfinished = [i for i in ids if i not in results]
            if unfinished:  # interrupted: leave the engine clean
                self.engine.abort_request(unfinished)
        return [results[i] for i in ids]
