"""The engine's front: what runs beside the user rather than beside the model.

Tokenizer, prompt validation, turning a user request into the core's plain-data requests (n > 1 fans
out into n sequences), and the output processor that turns the core's tokens back into text. The
offline engine and the server's async engine both hold one; neither needs the model's weights (a
vision-language model's processor reads its shapes from a weightless copy on the meta device).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import torch

from splitserve.config import EngineConfig
from splitserve.protocol.core_messages import EngineCoreRequest
from splitserve.engine.output_processor import OutputProcessor, RequestState
from splitserve.loading.resolve import load_serving_tokenizer
from splitserve.sampling_params import SamplingParams, SamplingParamsError
from splitserve.tokenize_parallel import encode_text

logger = logging.getLogger(__name__)


def load_front_tokenizer(config: EngineConfig):
    return load_serving_tokenizer(config.load.source, config.load.tokenizer_source, config.load.random_weights)


def build_front_mm_processor(config: EngineConfig, tokenizer, model=None):
    """The image processor of a vision-language model (None for text-only). It needs the model's
    image token and feature counts, not its weights: without a model at hand a meta-device copy serves."""
    from splitserve.models.registry import get_model_class
    from splitserve.models.processors import build_mm_processor
    if model is None:
        _, cls = get_model_class(config.model.hf_config.architectures, config.model.hf_config)
        if not getattr(cls, "is_multimodal", False):
            return None
        with torch.device("meta"):
            model = cls(config.model.hf_config)
    processor = build_mm_processor(model, config.load.source, tokenizer)
    if processor is not None:
        processor.max_model_len = config.model.max_model_len
        device = config.multimodal.preprocess_device
        if device is not None and hasattr(processor, "set_preprocess_device"):
            processor.set_preprocess_device(device)
    return processor


class EngineFront:
    encoder_decoder = False  # set per model in __init__ (class defaults for stand-ins that skip it)
    decoder_start_token_id = None
    encoder_prompt_has_images = False

    def __init__(self, config: EngineConfig, tokenizer, num_blocks: int, block_size: int, mm_processor=None,
                 stream_interval: int = 1):
        self.source = config.load.source
        self.model_name = config.model_name
        self.world_size = config.world_size
        self.served_model_names = config.served_model_names
        # SamplingParams fields a request that leaves them unset takes (the generation config's).
        self.sampling_defaults = dict(config.sampling_defaults)
        if self.sampling_defaults:
            logger.info("requests default to the model's generation config: %s (--generation-config vllm "
                        "turns this off)", ", ".join(f"{k}={v}" for k, v in sorted(self.sampling_defaults.items())))
        self.tokenizer = tokenizer
        eos = set(config.model.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.config = dataclasses.replace(
            config, model=dataclasses.replace(config.model, eos_token_ids=tuple(sorted(eos))))
        self.mm_processor = mm_processor
        self.kv_capacity_tokens = num_blocks * block_size
        self.block_size = block_size
        # Encoder-decoder models (T5): the text prompt is the encoder's input, the decoder starts
        # from the model's decoder start token.
        hf = config.model.hf_config
        self.encoder_decoder = bool(getattr(hf, "is_encoder_decoder", False))
        self.decoder_start_token_id = getattr(hf, "decoder_start_token_id", None)
        if self.encoder_decoder and self.decoder_start_token_id is None:
            self.decoder_start_token_id = getattr(hf, "pad_token_id", None) or 0
        # BLIP-2 T5: the prompt's images sit in the encoder's input (models/blip2_t5.py)
        self.encoder_prompt_has_images = bool(getattr(getattr(mm_processor, "model", None),
                                                      "encoder_prompt_has_images", False))
        model = getattr(mm_processor, "model", None)
        self.output_processor = OutputProcessor(tokenizer, stream_interval, getattr(model, "postprocess_text", None),
                                                getattr(model, "postprocess_markdown", None))
        self._ids = itertools.count()
        from splitserve.lora.registry import LoRARegistry
        # LoRA adapters by name (--lora-modules, runtime loads) and the check of a request's adapter.
        self.loras = LoRARegistry(config.lora, config.model.hf_config, self.model_name)

    @property
    def states(self) -> dict[str, RequestState]:
        return self.output_processor.states

    def tokenize_prompt(self, prompt: str | list[int], params: SamplingParams | None = None) -> list[int]:
        """The prompt's token ids; with params, cut to their truncate_prompt_tokens (the last k)."""
        k = params.truncate_prompt_tokens if params is not None else None
        if hasattr(prompt, "mm_items"):
            if k is not None:
                raise SamplingParamsError("truncate_prompt_tokens",
                                          "truncate_prompt_tokens cannot cut a prompt with images")
            return prompt  # a MultiModalPrompt: expanded ids that carry their images along
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            ids = (self.mm_processor.text_prompt_ids(prompt) if self.mm_processor is not None
                   else encode_text(self.tokenizer, prompt, add_special_tokens=True))  # long texts in pieces
        else:
            ids = list(prompt)
            check = getattr(self.mm_processor, "check_token_ids", None)
            if check is not None:  # a placeholder id with no image behind it
                check(ids)
        return ids if k is None else self.truncate(ids, k)

    def truncate(self, ids: list[int], k: int) -> list[int]:
        """The last k tokens (vLLM's truncate_prompt_tokens; -1: the model's context)."""
        limit = self.config.model.max_model_len
        if k > limit:
            raise SamplingParamsError("truncate_prompt_tokens", f"truncate_prompt_tokens ({k}) is greater than "
                                      f"max_model_len ({limit}); choose a smaller truncation size")
        k = limit if k == -1 else k
        return ids[-k:] if len(ids) > k else ids

    def check_priority(self, priority: int) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise SamplingParamsError("priority", f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.config.scheduler.policy != "priority":
            raise SamplingParamsError("priority", f"priority {priority} needs the priority scheduling policy "
                                      f"(--scheduling-policy priority); this engine runs "
                                      f"{self.config.scheduler.policy}")

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Checks a tokenized request against the model and cache; returns its total-token cap."""
        if not prompt_ids:
            raise ValueError("prompt is empty")
        limit = self.config.model.max_model_len
        n = len(prompt_ids)  # the length first: a huge prompt is turned away before any per-token work
        if n >= limit:
            raise ValueError(f"prompt has {n} tokens, but the model's context is {limit} tokens "
                             f"(max_model_len), leaving no room for output")
        vocab = self.config.model.vocab_size
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:5]}")
        self._validate_token_params(params, vocab)
        if params.prompt_logprobs is not None and self.world_size > 1:
            # The rank workers (executor/rank_worker.py) do not compute them yet: refuse, never drop.
            raise SamplingParamsError("prompt_logprobs", f"prompt_logprobs is not supported yet with several ranks "
                                                         f"(world size {self.world_size})")
        if params.max_tokens is not None and n + params.max_tokens > limit:
            raise SamplingParamsError("max_tokens", f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = "
                                                    f"{n + params.max_tokens} tokens exceeds the model's context of "
                                                    f"{limit} tokens")
        total = limit if params.max_tokens is None else n + params.max_tokens
        need = n + (params.max_tokens or 1)  # without max_tokens, output is capped by the cache instead
        if need > self.kv_capacity_tokens:
            raise ValueError(f"request needs {need} tokens of KV cache, but the cache holds only "
                             f"{self.kv_capacity_tokens} tokens")
        return min(total, self.kv_capacity_tokens)

    @staticmethod
    def _validate_token_params(params: SamplingParams, vocab: int) -> None:
        """Token ids the model cannot produce, and grammars that cannot compile, are the caller's error."""
        for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise SamplingParamsError(name, f"{name} holds token ids outside the vocabulary [0, {vocab}): "
                                                f"{bad[:5]}")
        if params.structured_outputs is not None:
            from splitserve.structured_output.grammar import check_structured_outputs
            check_structured_outputs(params.structured_outputs)  # cached by schema: a repeat costs nothing

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as token ids, both as it stands and after a space (a word starts a text or
        follows a space: the tokens differ), without duplicates."""
        seqs: list[list[int]] = []
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = list(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in seqs:
                    seqs.append(ids)
        return seqs

    def new_request(self, request_id: str | None, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, stream: bool = True,
                    lora_request=None, priority: int = 0) -> tuple[str, list[EngineCoreRequest]]:
        """Tokenizes and validates a request, registers it with the output processor, and returns its
        id with the core requests of its sequences (one, or n for parallel samples). `lora_request`:
        a lora.request.LoRARequest, or None for the base model."""
        params = params or SamplingParams()
        self.check_priority(priority)
        if lora_request is not None:
            self.loras.check(lora_request)
        vocab = self.config.model.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):  # never sampled: dropping them changes nothing
            params = params.replace_valid(stop_token_ids=[t for t in params.stop_token_ids if t < vocab])
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.output_processor.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids = self.tokenize_prompt(prompt, params)
        encoder_ids: list[int] = []
        num_encoder_tokens = 0
        mm_items = tuple(getattr(prompt_ids, "mm_items", ()))
        if self.encoder_decoder and mm_items and not self.encoder_prompt_has_images:
            # an image encoder: the model's processor built the decoder prompt and the encoder's items
            num_encoder_tokens = self.validate_encoder_length(sum(it.num_tokens for it in prompt_ids.mm_items), params)
        elif self.encoder_decoder:
            # the prompt (BLIP-2 T5: with its images' placeholder runs) is the encoder's input
            encoder_ids, prompt_ids = self.validate_encoder(list(prompt_ids), params), [self.decoder_start_token_id]
            num_encoder_tokens = len(encoder_ids)
        total = self.validate(prompt_ids, params)
        bad_words = self.bad_words_token_ids(params.bad_words) if params.bad_words else []
        arrival = arrival_time or time.monotonic()
        eos = self.config.model.eos_token_ids
        state = RequestState(request_id, prompt if isinstance(prompt, str) else None, list(prompt_ids), params,
                             eos, arrival, self.tokenizer, stream)
        state.num_encoder_tokens = num_encoder_tokens
        self.output_processor.add_request(state)
        return request_id, [EngineCoreRequest(c.request_id, list(prompt_ids), c.params, eos, total, arrival, mm_items,
                                              lora_request, priority, list(encoder_ids), num_encoder_tokens, bad_words)
                            for c in state.children]

    def validate_encoder(self, encoder_ids: list[int], params: SamplingParams) -> list[int]:
        """Checks an encoder-decoder request's encoder input (the tokenized prompt): its encoder runs
        whole in one step, so it must fit the step's token budget with the decoder's first token, and
        its cross K/V must fit the cache beside the decoder's tokens."""
        if not encoder_ids:
            raise ValueError("prompt is empty")
        vocab = self.config.model.vocab_size
        bad = [t for t in encoder_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:5]}")
        self.validate_encoder_length(len(encoder_ids), params)
        return encoder_ids

    def validate_encoder_length(self, n: int, params: SamplingParams) -> int:
        budget = self.config.scheduler.max_num_batched_tokens
        if n >= budget:
            raise ValueError(f"the encoder input has {n} positions; this encoder-decoder model runs a request's "
                             f"encoder in one step of at most {budget - 1} (max_num_batched_tokens {budget}, one "
                             f"for the decoder)")
        bs = self.block_size
        need = -(-n // bs) * bs + 1 + (params.max_tokens or 1)
        if need > self.kv_capacity_tokens:
            raise ValueError(f"request needs {need} tokens of KV cache (encoder and decoder), but the cache holds "
                             f"only {self.kv_capacity_tokens} tokens")
        return n


class FrontView:
    """What the front knows, read through an engine object that holds one (`self.front`): the
    offline engine (llm_engine.py) and the data-parallel one (replicated_llm_engine.py)."""
    front: "EngineFront"

    @property
    def tokenizer(self):
        return self.front.tokenizer

    @property
    def config(self):
        return self.front.config

    @property
    def model_name(self) -> str:
        return self.front.model_name

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return self.front.served_model_names

    @property
    def sampling_defaults(self) -> dict:
        return self.front.sampling_defaults

    @property
    def source(self):
        return self.front.source

    @property
    def mm_processor(self):
        return self.front.mm_processor

    @property
    def kv_capacity_tokens(self) -> int:
        return self.front.kv_capacity_tokens

    @property
    def states(self):
        return self.front.states

    def tokenize_prompt(self, prompt, params=None):
        return self.front.tokenize_prompt(prompt, params)

    def validate(self, prompt_ids: list[int], params) -> int:
        return self.front.validate(prompt_ids, params)
