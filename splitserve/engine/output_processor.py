"""From sampled token ids to user-facing outputs: incremental detokenization, stop strings, n-way fan-in."""
from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.logprobs import Logprob, ranked
from splitserve.sampling_params import SamplingParams

try:
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:  # pragma: no cover - tokenizers is a transformers dependency
    _DecodeStream = None

# Prompt tokens kept as left context so the first output tokens decode as they would mid-text.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Decodes a growing token list piece by piece. A piece is released only once it decodes to
    complete characters (no trailing U+FFFD), so multi-token characters never come out split."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        # Fast tokenizers decode incrementally in Rust (~1 us a token instead of two Python decodes).
        self._backend = getattr(tokenizer, "_tokenizer", None)
        self._stream = None
        if self._backend is not None and _DecodeStream is not None:
            try:
                self._stream = _DecodeStream(ids=self.tokens, skip_special_tokens=skip_special_tokens)
            except TypeError:  # older tokenizers: no priming ids
                self._stream = None

    def add(self, token_id: int) -> str:
        if self._stream is not None:
            try:
                return self._stream.step(self._backend, token_id) or ""
            except Exception:  # e.g. an id outside the tokenizer's vocabulary (random-weight models)
                return ""
        self.tokens.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.tokens[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special)
        full = decode(self.tokens[self.prefix_offset:], skip_special_tokens=self.skip_special)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            return full[len(prefix):]
        return ""


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    # What is new since the previous output of this request (for streaming).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[dict[int, Logprob]] | None = None
    # A model's post-processing of the finished text (Kosmos-2 grounding: {"text", "entities"}).
    grounding: dict | None = None
    # Nougat: transformers' markdown post-processing of the finished text (models/nougat/model.py).
    markdown: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    # Seconds from arrival until first scheduled (filled once).
    queue_time: float | None = None
    # prompt_logprobs (vLLM's shape): None for the first prompt token, then per prompt token its
    # {token_id: Logprob} (the prompt token itself and the top k); set from the first output token on.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # An encoder-decoder request's encoder positions (prompt_token_ids are then the decoder's start
    # token): the API counts both as the prompt, as vLLM counts Whisper's encoder prompt.
    num_encoder_tokens: int = 0
    # A KV producer's answer (vLLM's kv_transfer_params) for the decode engine; with the final output.
    kv_transfer_params: dict | None = None


class _ChildState:
    """One sequence (of the n a request samples) as the front sees it: tokens, text, what was sent."""

    def __init__(self, request_id: str, index: int, params: SamplingParams, prompt_token_ids: list[int],
                 tokenizer):
        self.request_id = request_id
        self.index = index
        self.params = params
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text = ""
        self.sent_text = 0     # chars of text already delivered
        self.sent_tokens = 0   # tokens already delivered
        self.holdback = max((len(s) for s in params.stop), default=1) - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestState:
    """One user request: its n children (parallel samples) and what has been delivered of each."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...], arrival_time: float, tokenizer, stream: bool = True):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.eos_token_ids = eos_token_ids
        n = params.n
        self.children = [_ChildState(request_id if n == 1 else f"{request_id}#{i}", i,
                                     params if n == 1 else params.for_child(i), prompt_token_ids, tokenizer)
                         for i in range(n)]
        self.arrival_time = arrival_time
        self.stream = stream  # report progress as it comes, not only the end
        self.num_cached_tokens = 0
        self.first_token_time: float | None = None
        self.queue_time: float | None = None
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.num_encoder_tokens = 0  # set by the front for encoder-decoder requests
        self.kv_transfer_params: dict | None = None

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)

    def set_prompt_logprobs(self, entries: list[dict[int, float]], ranks: list[int] | None) -> None:
        """The core's prompt logprobs (one entry per prompt token after the first); every child
        sends the same ones, the first to arrive is kept."""
        if self.prompt_logprobs is None:
            ranks = ranks or [None] * len(entries)
            self.prompt_logprobs = [None] + [ranked(e, r) for e, r in zip(entries, ranks)]

    def add_tokens(self, child: _ChildState, token_ids: list[int], logprobs, finish_reason: str | None,
                   stop_reason, logprob_ranks: list[int] | None = None) -> str | None:
        """Appends a child's new tokens and detokenizes them; returns the stop string they completed,
        if any (the child then ends with finish reason "stop")."""
        params = child.params
        child.token_ids += token_ids
        if child.logprobs is not None and logprobs:
            ranks = logprob_ranks or [None] * len(logprobs)
            child.logprobs += [ranked(entry, rank) for entry, rank in zip(logprobs, ranks)]
        if finish_reason is not None:
            child.finish_reason, child.stop_reason = finish_reason, stop_reason
        num_out = len(child.token_ids)
        for i, token in enumerate(token_ids, start=num_out - len(token_ids)):
            if finish_reason == "stop" and i == num_out - 1 and params.skip_special_tokens \
                    and (token in self.eos_token_ids or token in params.stop_token_ids):
                continue  # a stop token is not part of the text
            piece = child.detok.add(token)
            if not piece:
                continue
            start = max(0, len(child.text) - child.holdback)
            child.text += piece
            if params.stop and i + 1 >= params.min_tokens:
                hit = self._find_stop(child.text, params.stop, start)
                if hit is not None:
                    pos, stop = hit
                    child.text = child.text[:pos + len(stop)] if params.include_stop_str_in_output else child.text[:pos]
                    del child.token_ids[i + 1:]  # tokens past the stop string are not output
                    if child.logprobs is not None:
                        del child.logprobs[i + 1:]
                    child.finish_reason, child.stop_reason = "stop", stop
                    return stop
        return None

    @staticmethod
    def _find_stop(text: str, stops: list[str], start: int):
        best = None
        for stop in stops:
            pos = text.find(stop, start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        return best

    def finish_all(self, reason: str) -> list[str]:
        """Ends every unfinished child with `reason`; returns their ids (for the core to drop)."""
        ended = [c for c in self.children if not c.finished]
        for c in ended:
            c.finish_reason = reason
        return [c.request_id for c in ended]

    def unsent_tokens(self) -> int:
        return max(len(c.token_ids) - c.sent_tokens for c in self.children)

    def make_output(self, streaming_holdback: bool = True) -> RequestOutput:
        outputs = []
        for c in self.children:
            finished = c.finished
            # While running, hold back the tail that might still become a stop string.
            visible = len(c.text) if finished or not streaming_holdback else max(c.sent_text, len(c.text) - c.holdback)
            outputs.append(CompletionOutput(
                index=c.index, text=c.text[:visible], token_ids=list(c.token_ids),
                finish_reason=c.finish_reason, stop_reason=c.stop_reason, logprobs=c.logprobs,
                delta_text=c.text[c.sent_text:visible],
                delta_token_ids=c.token_ids[c.sent_tokens:],
                delta_logprobs=None if c.logprobs is None else c.logprobs[c.sent_tokens:]))
            c.sent_text, c.sent_tokens = visible, len(c.token_ids)
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
            outputs=outputs, finished=self.finished, num_cached_tokens=self.num_cached_tokens,
            arrival_time=self.arrival_time, first_token_time=self.first_token_time, queue_time=self.queue_time,
            prompt_logprobs=self.prompt_logprobs, num_encoder_tokens=self.num_encoder_tokens,
            kv_transfer_params=self.kv_transfer_params)


class OutputProcessor:
    """The front's half of every request: turns the core's token outputs into RequestOutputs.

    `process` returns the outputs to deliver and the sequences the core must drop: stop strings are
    found here (the core sees no text), and a child that fails fails its siblings. With
    `stream_interval` N, a running request's output is delivered once N new tokens have gathered
    (1: every token is its own event); final outputs are always delivered at once."""

    def __init__(self, tokenizer, stream_interval: int = 1, text_postprocess=None, markdown_postprocess=None):
        """text_postprocess: the model's hook for finished texts (Kosmos-2's grounding), or None;
        markdown_postprocess: the same for Nougat's markdown (text -> str or None)."""
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.tokenizer = tokenizer
        self.text_postprocess = text_postprocess
        self.markdown_postprocess = markdown_postprocess
        self.stream_interval = stream_interval
        self.states: dict[str, RequestState] = {}
        self.children: dict[str, tuple[RequestState, _ChildState]] = {}  # sequence id -> its request

    def add_request(self, state: RequestState) -> None:
        if state.request_id in self.states:
            raise ValueError(f"request id {state.request_id!r} is already in use")
        self.states[state.request_id] = state
        for c in state.children:
            self.children[c.request_id] = (state, c)

    def has_unfinished(self) -> bool:
        return bool(self.states)

    def process(self, core_outputs, timestamp: float) -> tuple[list[RequestOutput], dict[str, list[str]]]:
        """-> (outputs to deliver, {"stop" | "error": sequence ids the core must still end})."""
        touched: dict[str, RequestState] = {}
        drop: dict[str, list[str]] = {}
        for o in core_outputs:
            entry = self.children.get(o.request_id)
            if entry is None:  # ended here already (a stop string, an abort): late tokens are dropped
                continue
            state, child = entry
            if child.finished:
                continue
            if o.new_token_ids and state.first_token_time is None:
                state.first_token_time = timestamp
                state.num_cached_tokens = o.num_cached_tokens
            if o.queue_time is not None and state.queue_time is None:
                state.queue_time = o.queue_time
            if o.kv_transfer_params is not None:
                state.kv_transfer_params = o.kv_transfer_params
            if o.prompt_logprobs is not None:
                state.set_prompt_logprobs(o.prompt_logprobs, o.prompt_logprob_ranks)
            stop = state.add_tokens(child, o.new_token_ids, o.new_logprobs, o.finish_reason, o.stop_reason,
                                    o.new_logprob_ranks)
            if stop is not None and o.finish_reason is None:
                drop.setdefault("stop", []).append(child.request_id)
            if o.finish_reason == "error":  # one failed sample fails the request
                drop.setdefault("abort", []).extend(state.finish_all("error"))
            touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            if state.finished:
                outputs.append(self._finish(state))
            elif state.stream and state.unsent_tokens() >= self.stream_interval:
                outputs.append(state.make_output())
        return outputs, drop

    def abort(self, request_id: str, reason: str = "abort") -> tuple[RequestOutput | None, list[str]]:
        """Ends a request here; -> (its final output, the sequence ids the core must drop)."""
        state = self.states.get(request_id)
        if state is None:
            return None, []
        ids = state.finish_all(reason)
        return self._finish(state), ids

    def _finish(self, state: RequestState) -> RequestOutput:
        out = state.make_output()
        if self.text_postprocess is not None:
            for o in out.outputs:
                o.grounding = self.text_postprocess(o.text)
        if self.markdown_postprocess is not None:
            for o in out.outputs:
                o.markdown = self.markdown_postprocess(o.text)
        self.states.pop(state.request_id, None)
        for c in state.children:
            self.children.pop(c.request_id, None)
        return out
