"""Completion and chat handlers: requests into engine streams, engine outputs into OpenAI bodies.

Streaming follows the OpenAI wire format: `data: <json>\\n\\n` events, each choice's finish_reason
sent exactly once, an optional usage chunk with `choices: []`, then `data: [DONE]`. A client that
goes away aborts its requests: for streams Starlette cancels the body generator when it sees the
disconnect; for plain responses a watcher task waits for the disconnect message.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache, partial
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from splitserve.ttft_trace import front_log
from splitserve.engine.async_engine import (AsyncLLMEngine, EngineOverloadedError, EngineRequestError,
                                            EngineShutdownError, RequestStream)
from splitserve.engine.output_processor import CompletionOutput, RequestOutput
from splitserve.entrypoints.openai.protocol import (
    APIError, ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatCompletionStreamResponse,
    ChatStreamChoice, CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
    CompletionStreamResponse, DeltaMessage, TokenizeRequest, TokenizeResponse, UsageInfo)
from splitserve.entrypoints.openai import tool_calls_serving as tools_io
from splitserve.entrypoints.openai.serving_logprobs import (chat_logprobs, completion_logprobs, echo_logprobs,
                                                            prompt_logprobs_out)
from splitserve.entrypoints.openai.tool_choice import plan_tools, template_message
from splitserve.entrypoints.openai.sse import event_stream_response, sse as _sse
from splitserve.entrypoints.openai.serving_mm import (MediaPool, build_chat_prompt, build_messages_prompt,
                                                     chat_image_sources)
from splitserve.multimodal.media import MediaPolicy
from splitserve.multimodal.processor import IMAGE_MARKER, IMAGE_PART_TYPES, VIDEO_MARKER, VIDEO_PART_TYPES
from splitserve.sampling_params import SamplingParams, SamplingParamsError
from splitserve.tokenize_parallel import can_cut, encode_text

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
# Tokenizing a text (or rendering a chat template) costs ~1.4 s of CPU per MB: a 1024-token prompt
# is ~6 ms (measured on the H100 host, 1.30 s of the loop's CPU for 200 such prompts), which on the
# event loop delays every stream's next event. So all but short texts go to worker threads (HF fast
# tokenizers release the GIL while encoding); short ones stay on the loop, where they cost less than
# the hop to a thread.
_INLINE_TEXT_CHARS = 1024
_TOKENIZE_WORKERS = 4
# apply_chat_template arguments that change how it tokenizes: a chat_template_kwargs naming one keeps
# the template's own tokenization instead of rendering here and tokenizing with encode_text.
_CHAT_TOKENIZE_ARGS = frozenset({"tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
                                 "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"})


def overloaded(message: str) -> APIError:
    return APIError(503, message, type="service_unavailable", code="service_unavailable",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def json_response(body: BaseModel, status: int = 200) -> Response:
    """Serialized by pydantic, which writes a non-finite float (a -inf logprob) as null where
    json.dumps would raise."""
    return Response(body.model_dump_json(), status_code=status, media_type="application/json")


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, model_name: str, model_root: str | None = None,
                 log_requests: bool = False, tool_parser: str | None = None):
        self.engine = engine
        self.model_name = model_name
        # --served-model-name a b: clients may send any of them; responses name the first.
        self.served_model_names = tuple(getattr(engine.engine, "served_model_names", None) or (model_name,))
        # LoRA adapters clients select with model=NAME (lora/registry.py); None without a front (fakes)
        self.loras = getattr(getattr(engine, "front", None), "loras", None)
        self.on_lora_request = None  # (adapter name) -> None: the server's per-adapter request count
        # The server's ServerMetrics (None: not counted): every request handed to the engine is
        # counted in here, and one the engine refuses is counted out here (the others end in on_output).
        self.metrics = None
        self.model_root = model_root
        # The generation config's sampling defaults, for fields a request leaves unset.
        self.sampling_defaults = dict(getattr(engine.engine, "sampling_defaults", None) or {})
        self.log_requests = log_requests
        # --tool-call-parser when --enable-auto-tool-choice is on: reads calls out of `auto` answers.
        self.tool_parser = tool_parser
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.config.model.max_model_len
        self.quantization = engine.engine.config.model.quantization
        # Vision-language models: the image processor, and what image sources are allowed (build_app
        # replaces the default policy with the server's flags).
        self.mm_processor = getattr(engine.engine, "mm_processor", None)
        self.media_policy = MediaPolicy()
        # Decoding and preprocessing of images: worker threads, never the event loop (serving_mm.py).
        self.media_pool = MediaPool() if self.mm_processor is not None else None
        # Single-token decodes for logprobs; the vocabulary is fixed, so caching is safe.
        self.token_text = lru_cache(maxsize=65536)(self._decode_one)
        self._tokenize_pool = ThreadPoolExecutor(_TOKENIZE_WORKERS, thread_name_prefix="splitserve-tokenize")
        # SPLITSERVE_TTFT_LOG: one line per streamed request at its first event (ttft_trace.py)
        self.ttft_log = front_log()

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # -- shared ---------------------------------------------------------------------------------
    def check_model(self, model: str | None):
        """The LoRA adapter a model name selects (None: the base model); 404 for an unknown name."""
        if model is not None and model not in self.served_model_names:
            lora = self.loras.get(model) if self.loras is not None else None
            if lora is not None:
                return lora
            served = ", ".join(f"`{n}`" for n in self.served_model_names + self.lora_names())
            raise APIError(404, f"The model `{model}` does not exist; this server serves {served}.",
                           param="model", code="model_not_found")
        return None

    def lora_names(self) -> tuple[str, ...]:
        return tuple(self.loras.by_name) if self.loras is not None else ()

    async def _off_loop(self, text_chars: int, fn, *args, **kwargs):
        """fn(*args, **kwargs) on a tokenizer worker thread when it handles more than
        _INLINE_TEXT_CHARS characters of text, else right here."""
        if text_chars <= _INLINE_TEXT_CHARS:
            return fn(*args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, partial(fn, *args, **kwargs))

    @staticmethod
    def _chat_text_chars(messages, extra: dict | None) -> int:
        """The work a chat template does, in characters: the texts, plus a share per message (a
        template loops over them) and the template kwargs (a template may render them)."""
        n = 64 * len(messages) + (len(repr(extra)) if extra else 0)
        for m in messages:
            if isinstance(m.content, str):
                n += len(m.content)
            elif m.content:
                n += sum(64 + len(part.text or "") for part in m.content)
        return n

    def _tokenize_prompts(self, prompts: list) -> list[list[int]]:
        """Text prompts -> token ids, as the engine would tokenize them; token-id prompts as given."""
        ids = []
        for p in prompts:
            if isinstance(p, str):
                if not p:
                    raise APIError(400, "prompt is empty", param="prompt")
                p = encode_text(self.tokenizer, p, add_special_tokens=True)
            ids.append(p)
        return ids

    def _check_length(self, prompt: list[int], param: str) -> None:
        """The engine's context check, by length alone: a prompt of a million tokens is refused here
        at once instead of being walked id by id on the event loop by the engine's validation."""
        if len(prompt) >= self.max_model_len:
            raise APIError(400, f"prompt has {len(prompt)} tokens, but the model's context is {self.max_model_len} "
                                f"tokens (max_model_len), leaving no room for output", param=param)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True,
                            continue_final_message: bool = False, extra: dict | None = None,
                            tokenize: bool = True, tools: list | None = None) -> list[int] | str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, f"model `{self.model_name}` has no chat template; use /v1/completions",
                           param="messages")
        conversation = []
        for i, m in enumerate(messages):
            content = m.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part.type == "text" and part.text is not None:
                        texts.append(part.text)
                    elif part.type in IMAGE_PART_TYPES:
                        if self.mm_processor is None:
                            raise APIError(400, f"model `{self.model_name}` does not accept images",
                                           param=f"messages[{i}].content")
                        texts.append(IMAGE_MARKER)  # expanded to the image's tokens by the mm processor
                    elif part.type in VIDEO_PART_TYPES:
                        if getattr(self.mm_processor, "video_marker_id", None) is None:
                            raise APIError(400, f"model `{self.model_name}` does not accept videos",
                                           param=f"messages[{i}].content")
                        texts.append(VIDEO_MARKER)
                    else:
                        raise APIError(400, f"unsupported content part type {part.type!r}",
                                       param=f"messages[{i}].content")
                content = "\n".join(texts)
            conversation.append(template_message(m.role, content or "", m.name, m.model_extra))
        if continue_final_message and add_generation_prompt:
            add_generation_prompt = False  # continuing the last message leaves no room for a new turn
        # Rendered here and tokenized by encode_text (in pieces when long), as the template would
        # tokenize it: encode(text, add_special_tokens=False).
        own_tokenize = tokenize and can_cut(self.tokenizer) and not _CHAT_TOKENIZE_ARGS.intersection(extra or ())
        try:
            ids = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=tokenize and not own_tokenize,
                continue_final_message=continue_final_message, **({"tools": tools} if tools else {}), **(extra or {}))
        except Exception as e:  # template errors come from user content (roles, ordering)
            raise APIError(400, f"could not apply the chat template: {e}", param="messages") from None
        if own_tokenize:
            return encode_text(self.tokenizer, ids, add_special_tokens=False)
        if not tokenize:
            return ids
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    async def _check_constraint(self, params: SamplingParams, param: str) -> None:
        """Parses a structured output constraint before the request goes in: a large schema on a worker
        thread, not on the event loop (the engine's own check then finds it in its cache)."""
        so = params.structured_outputs
        if so is None:
            return
        from splitserve.structured_output.grammar import check_structured_outputs
        spec = so.json if so.json is not None else (so.regex or so.grammar or so.choice or "")
        size = len(spec) if isinstance(spec, str) else len(repr(spec))
        try:
            await self._off_loop(size, check_structured_outputs, so)
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None

    def _truncate(self, prompt, params: SamplingParams):
        """A token-id prompt cut to truncate_prompt_tokens, before its length is checked (the engine's
        front cuts it the same way; cutting twice changes nothing)."""
        if params.truncate_prompt_tokens is None or isinstance(prompt, str) or hasattr(prompt, "mm_items"):
            return prompt
        try:
            return self.engine.front.truncate(prompt, params.truncate_prompt_tokens)
        except ValueError as e:
            raise APIError(400, str(e), param="truncate_prompt_tokens") from None

    def _add(self, request_id: str, prompt, params: SamplingParams, param: str, lora_request=None,
             priority: int = 0) -> RequestStream:
        prompt = self._truncate(prompt, params)
        if not isinstance(prompt, str):
            self._check_length(prompt, param)
        if self.log_requests:  # never the text: prompts may be private
            size = f"{len(prompt)} characters" if isinstance(prompt, str) else f"{len(prompt)} tokens"
            logger.info("request %s: prompt of %s; n=%d temperature=%g top_p=%g top_k=%d min_p=%g "
                        "repetition_penalty=%g max_tokens=%s seed=%s logprobs=%s", request_id, size, params.n,
                        params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty,
                        params.max_tokens, params.seed, params.logprobs)
        try:
            stream = self._engine_add(request_id, prompt, params, lora_request, priority)
        except EngineOverloadedError as e:
            raise overloaded(str(e)) from None
        except EngineShutdownError as e:
            raise overloaded(str(e)) from None
        except SamplingParamsError as e:  # a parameter the front found wrong names itself
            raise APIError(400, str(e), param=e.param) from None
        except ValueError as e:  # the prompt (its length, ids, images), a reused id: the prompt's field
            raise APIError(400, str(e), param=param) from None
        if lora_request is not None and self.on_lora_request is not None:
            self.on_lora_request(lora_request.lora_name)
        return stream

    def _engine_add(self, request_id: str, prompt, params: SamplingParams, lora_request, priority: int
                    ) -> RequestStream:
        """The one door into the engine, and so the one place requests are counted in. A refusal
        (overloaded, shutting down, bad input) leaves no stream for on_output to see end: it is
        counted out here."""
        if self.metrics is not None:
            self.metrics.on_request_added()
        try:
            return self.engine.add_request(request_id, prompt, params, lora_request=lora_request, priority=priority)
        except BaseException:
            if self.metrics is not None:
                self.metrics.on_request_rejected()
            raise

    def _add_all(self, base_id: str, prompts: list, params: SamplingParams, param: str,
                 lora_request=None, priority: int = 0) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                streams.append(self._add(rid, prompt, params, param, lora_request, priority))
        except BaseException:
            self._abort(streams)  # all or nothing: a bad prompt in a batch leaves no work behind
            raise
        return streams

    def _abort(self, streams: list[RequestStream]) -> None:
        for s in streams:
            if not s.finished:
                self.engine.abort(s.request_id)

    async def _collect(self, raw: Request, streams: list[RequestStream]) -> list[RequestOutput]:
        """Waits for the final output of each stream; aborts them all if the client disconnects."""
        async def last(stream: RequestStream) -> RequestOutput:
            final = None
            async for out in stream:
                final = out
            return final

        async def watch() -> None:
            while (await raw.receive())["type"] != "http.disconnect":
                pass
            logger.info("client disconnected; aborting %d request(s)", len(streams))
            self._abort(streams)

        watcher = asyncio.create_task(watch())
        try:
            finals = await asyncio.gather(*(last(s) for s in streams))
        except EngineRequestError as e:
            raise APIError(500, str(e), type="internal_server_error", code="internal_error") from None
        except EngineShutdownError as e:
            raise overloaded(str(e)) from None
        finally:
            watcher.cancel()
            self._abort(streams)
        if any(o.finish_reason == "abort" for f in finals for o in f.outputs):
            raise overloaded("the request was aborted (client gone or server shutting down)")
        return finals

    @staticmethod
    async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of several streams as they come, tagged with the stream's position."""
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
            except BaseException as e:
                queue.put_nowait((i, e))
            queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    def _stream_response(self, body: AsyncIterator[str], streams: list[RequestStream]) -> StreamingResponse:
        return event_stream_response(body, lambda: self._abort(streams))

    @staticmethod
    def _prompt_tokens(out: RequestOutput) -> int:
        """The prompt's tokens as usage counts them: with an encoder-decoder model, the encoder's
        input positions (text tokens, image patches or encoder positions) and the decoder's prompt
        (its start token), as vLLM counts a Whisper request's encoder prompt."""
        return len(out.prompt_token_ids) + out.num_encoder_tokens

    @classmethod
    def _usage(cls, finals: list[RequestOutput]) -> UsageInfo:
        prompt = sum(cls._prompt_tokens(f) for f in finals)
        completion = sum(len(o.token_ids) for f in finals for o in f.outputs)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    # -- /tokenize -------------------------------------------------------------------------------
    async def tokenize(self, req: TokenizeRequest) -> Response:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            if not req.messages:
                raise APIError(400, "messages is empty", param="messages")
            text_chars = self._chat_text_chars(req.messages, None)
        else:
            text_chars = len(req.prompt)

        def run() -> str:
            # The answer is built here too: a million ids take a while to validate and serialize.
            if req.messages is not None:
                ids = self.apply_chat_template(req.messages, req.add_generation_prompt)
            else:
                ids = list(self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
            return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids).model_dump_json()

        return Response(await self._off_loop(text_chars, run), media_type="application/json")

    # -- /v1/completions ------------------------------------------------------------------------
    async def create_completion(self, req: CompletionRequest, raw: Request):
        ttft_start = self.ttft_log.start() if self.ttft_log is not None else None
        lora = self.check_model(req.model)
        params = req.to_sampling_params(self.sampling_defaults)
        await self._check_constraint(params, req.constraint_field)
        prompts = req.prompts()
        request_id = f"cmpl-{uuid.uuid4().hex}"
        text_chars = sum(len(p) for p in prompts if isinstance(p, str))
        prompt_ids = await self._off_loop(text_chars, self._tokenize_prompts, prompts)
        prompt_ids = [self._truncate(p, params) for p in prompt_ids]
        streams = self._add_all(request_id, prompt_ids, params, "prompt", lora, req.priority)
        for stream in streams if ttft_start is not None else ():
            stream.ttft_start = ttft_start
        # echo: the prompt as given, or the tokens left of it after truncate_prompt_tokens
        cut = params.truncate_prompt_tokens is not None
        echoes = [self._echo_text(ids if cut else p) if req.echo else "" for p, ids in zip(prompts, prompt_ids)]
        if req.stream:
            return self._stream_response(self._completion_events(req, request_id, streams, params, echoes,
                                                                 [len(p) for p in prompt_ids]), streams)
        finals = await self._collect(raw, streams)
        choices = []
        for i, final in enumerate(finals):
            for o in final.outputs:
                lp = None
                if params.logprobs is not None:
                    lp = echo_logprobs(self.token_text, final.prompt_token_ids, final.prompt_logprobs) \
                        if req.echo else None
                    lp = completion_logprobs(self.token_text, o.token_ids, o.logprobs or [], len(echoes[i]), lp)
                choices.append(CompletionChoice(index=i * params.n + o.index, text=echoes[i] + o.text, logprobs=lp,
                                                finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                                                prompt_logprobs=prompt_logprobs_out(self.token_text,
                                                                                    final.prompt_logprobs),
                                                grounding=o.grounding, markdown=o.markdown))
        body = CompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=self._usage(finals),
                                  kv_transfer_params=finals[0].kv_transfer_params if len(finals) == 1 else None)
        return json_response(body)

    def _echo_text(self, prompt) -> str:
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt, skip_special_tokens=False)

    async def _completion_events(self, req: CompletionRequest, request_id: str, streams: list[RequestStream],
                                 params: SamplingParams, echoes: list[str],
                                 prompt_lens: list[int]) -> AsyncIterator[str]:
        n = params.n
        finished: set[int] = set()
        offsets = {i * n + j: len(echoes[i]) for i in range(len(streams)) for j in range(n)}
        finals: dict[int, RequestOutput] = {}
        # Streamed choices have no prompt_logprobs field (vLLM's neither).
        exclude: dict = {"choices": {"__all__": {"prompt_logprobs"}}}
        if not req.include_usage:
            exclude["usage"] = True
        created = int(time.time())  # one timestamp for every chunk, as OpenAI does
        # echo with logprobs: the prompt's chunk waits for its logprobs, which come with the first token.
        echo_lp = params.logprobs is not None
        pending_echo = {i for i, echo in enumerate(echoes) if echo}

        def chunk(index: int, text: str, o: CompletionOutput | None, finish: str | None,
                  lp: CompletionLogprobs | None) -> str:
            choice = CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=finish,
                                      stop_reason=o.stop_reason if (o is not None and finish) else None)
            usage = None
            if req.continuous_usage:  # this choice's tokens so far
                prompt, done = prompt_lens[index // n], len(o.token_ids) if o is not None else 0
                usage = UsageInfo(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)
            body = CompletionStreamResponse(id=request_id, created=created, model=self.model_name, choices=[choice],
                                            usage=usage)
            return _sse(body.model_dump_json(exclude=exclude))

        def echo_chunks(i: int, out: RequestOutput | None):
            pending_echo.discard(i)
            lp = echo_logprobs(self.token_text, out.prompt_token_ids, out.prompt_logprobs) if out else None
            return [chunk(i * n + j, echoes[i], None, None, lp) for j in range(n)]

        if not echo_lp:
            for i in sorted(pending_echo):
                for c in echo_chunks(i, None):
                    yield c
        async for i, out in self._merge(streams):
            prompt_lens[i] = self._prompt_tokens(out)  # (an encoder-decoder request's encoder input too)
            if i in pending_echo:
                for c in echo_chunks(i, out):
                    yield c
            if out.finished:
                finals[i] = out
            for o in out.outputs:
                index = i * n + o.index
                if index in finished:
                    continue
                finish = o.finish_reason
                lp = None
                if params.logprobs is not None and o.delta_token_ids:
                    lp = completion_logprobs(self.token_text, o.delta_token_ids, o.delta_logprobs or [],
                                             offsets[index])
                    offsets[index] += sum(len(t) for t in lp.tokens)
                if not o.delta_token_ids and finish is None:
                    continue  # a token whose text is still held back is still an event (empty text)
                if finish is not None:
                    finished.add(index)
                yield chunk(index, o.delta_text, o, finish, lp)
                if self.ttft_log is not None:  # (after the yield: the event has been sent)
                    self.ttft_log.first_event(streams[i])
        if req.include_usage:
            body = CompletionStreamResponse(id=request_id, created=created, model=self.model_name, choices=[],
                                            usage=self._usage([finals[i] for i in sorted(finals)]))
            yield _sse(body.model_dump_json())
        yield _sse("[DONE]")

    # -- /v1/chat/completions -------------------------------------------------------------------
    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request):
        ttft_start = self.ttft_log.start() if self.ttft_log is not None else None
        lora = self.check_model(req.model)
        params = req.to_sampling_params(self.sampling_defaults)
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_parser)
        params = tools_io.constrain(plan, params, self.tool_parser)
        await tools_io.check_tools(self, plan)
        await self._check_constraint(params, "tools" if tools_io.constrained(plan) else req.constraint_field)
        sources = chat_image_sources(req.messages) if self.mm_processor is not None else []
        if sources and hasattr(self.mm_processor, "chat_prompt_from_messages"):  # no chat template (Pix2Struct)
            prompt = await build_messages_prompt(self.mm_processor, self.media_policy,
                                                 [m.model_dump() for m in req.messages], sources, self.media_pool)
        else:
            prompt = await self._off_loop(self._chat_text_chars(req.messages, req.chat_template_kwargs),
                                          self.apply_chat_template, req.messages, req.add_generation_prompt,
                                          req.continue_final_message, req.chat_template_kwargs, tokenize=not sources,
                                          tools=req.tools)
        if sources and not hasattr(self.mm_processor, "chat_prompt_from_messages"):
            prompt = await build_chat_prompt(self.mm_processor, self.media_policy, prompt, sources, self.media_pool)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        prompt = self._truncate(prompt, params)
        streams = self._add_all(request_id, [prompt], params, "messages", lora, req.priority)
        if ttft_start is not None:
            streams[0].ttft_start = ttft_start
        top_k = req.top_logprobs or 0
        if req.stream:
            return self._stream_response(self._chat_events(req, request_id, streams[0], params, top_k, plan,
                                                           len(prompt)), streams)
        final = (await self._collect(raw, streams))[0]
        choices = []
        for o in final.outputs:
            lp = chat_logprobs(self.token_text, o.token_ids, o.logprobs or [], top_k) if req.logprobs else None
            message, finish = tools_io.message_out(plan, self.tool_parser, o.text, o.finish_reason)
            choices.append(ChatChoice(index=o.index, message=message, logprobs=lp,
                                      finish_reason=finish, stop_reason=o.stop_reason, grounding=o.grounding,
                                      markdown=o.markdown))
        body = ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                      usage=self._usage([final]),
                                      prompt_logprobs=prompt_logprobs_out(self.token_text, final.prompt_logprobs),
                                      kv_transfer_params=final.kv_transfer_params)
        return json_response(body)

    async def _chat_events(self, req: ChatCompletionRequest, request_id: str, stream: RequestStream,
                           params: SamplingParams, top_k: int, plan=None, prompt_len: int = 0) -> AsyncIterator[str]:
        exclude = None if req.include_usage else {"usage"}
        finished: set[int] = set()
        final: RequestOutput | None = None
        created = int(time.time())
        num_out = [0] * params.n  # each choice's tokens so far (continuous usage)

        def chunk(index: int, delta: DeltaMessage, finish: str | None = None, lp=None, stop_reason=None) -> str:
            usage = None
            if req.continuous_usage:
                done = num_out[index]
                usage = UsageInfo(prompt_tokens=prompt_len, completion_tokens=done, total_tokens=prompt_len + done)
            body = ChatCompletionStreamResponse(id=request_id, created=created, model=self.model_name,
                                                choices=[ChatStreamChoice(
                index=index, delta=delta, logprobs=lp, finish_reason=finish, stop_reason=stop_reason)], usage=usage)
            return _sse(body.model_dump_json(exclude=exclude))

        # The role comes first, at once, as OpenAI does: clients see the stream open before prefill.
        for j in range(params.n):
            yield chunk(j, DeltaMessage(role="assistant", content=""))
        # Per choice: turns text deltas into content and tool-call deltas (None: plain text).
        tool_streams = {j: tools_io.ToolDeltas(plan, self.tool_parser) for j in range(params.n)} \
            if tools_io.reads_calls(plan, self.tool_parser) else {}
        async for _, out in self._merge([stream]):
            prompt_len = self._prompt_tokens(out)  # (an encoder-decoder request's encoder input too)
            if out.finished:
                final = out
            for o in out.outputs:
                if o.index in finished:
                    continue
                num_out[o.index] = len(o.token_ids)
                finish = o.finish_reason
                lp = None
                if req.logprobs and o.delta_token_ids:
                    lp = chat_logprobs(self.token_text, o.delta_token_ids, o.delta_logprobs or [], top_k)
                if not o.delta_token_ids and finish is None:
                    continue  # a token whose text is still held back is still an event (empty text)
                if finish is not None:
                    finished.add(o.index)
                delta = DeltaMessage(content=o.delta_text) if (o.delta_token_ids or lp is not None) else DeltaMessage()
                if o.index in tool_streams:
                    deltas, finish = tool_streams[o.index].step(o.delta_text, finish)
                    if finish is None and not deltas and lp is None:
                        continue
                    for extra in deltas[:-1]:  # several pieces in one step: one event each
                        yield chunk(o.index, extra)
                    delta = deltas[-1] if deltas else DeltaMessage()
                yield chunk(o.index, delta, finish, lp, o.stop_reason if finish else None)
                if self.ttft_log is not None:  # (after the yield: the event has been sent)
                    self.ttft_log.first_event(stream)
        if req.include_usage and final is not None:
            body = ChatCompletionStreamResponse(id=request_id, created=created, model=self.model_name, choices=[],
                                                usage=self._usage([final]))
            yield _sse(body.model_dump_json())
        yield _sse("[DONE]")
