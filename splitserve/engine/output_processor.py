"""From sampled token ids to user-facing outputs: incremental detokenization, stop strings, n-way fan-in."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from splitserve.request import Request, RequestStatus

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
    logprobs: list[dict[int, float]] | None = None
    # What is new since the previous output of this request (for streaming).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[dict[int, float]] | None = None

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


class _ChildState:
    def __init__(self, request: Request, index: int, tokenizer):
        self.request = request
        self.index = index
        self.params = request.sampling_params
        self.detok = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, self.params.skip_special_tokens)
        self.text = ""
        self.sent_text = 0     # chars of text already delivered
        self.sent_tokens = 0   # tokens already delivered
        self.holdback = max((len(s) for s in self.params.stop), default=1) - 1


class RequestState:
    """One user request: its n children (parallel samples) and what has been delivered of each."""

    def __init__(self, request_id: str, prompt: str | None, children: list[Request], tokenizer):
        self.request_id = request_id
        self.prompt = prompt
        self.children = [_ChildState(r, i, tokenizer) for i, r in enumerate(children)]
        self.arrival_time = children[0].arrival_time
        self.stream = True  # report every step's progress, not only the end

    @property
    def finished(self) -> bool:
        return all(c.request.is_finished for c in self.children)

    def process_tokens(self, child: _ChildState, num_new: int) -> str | None:
        """Detokenizes the child's newest tokens; returns the stop string it hit, if any."""
        r, params = child.request, child.params
        out_ids = r.output_token_ids
        for i in range(len(out_ids) - num_new, len(out_ids)):
            token = out_ids[i]
            if r.is_finished and i == len(out_ids) - 1 and r.status == RequestStatus.FINISHED_STOPPED \
                    and (token in r.eos_token_ids or token in params.stop_token_ids) and params.skip_special_tokens:
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

    def make_output(self, streaming_holdback: bool = True) -> RequestOutput:
        outputs = []
        for c in self.children:
            r = c.request
            finished = r.is_finished
            # While running, hold back the tail that might still become a stop string.
            visible = len(c.text) if finished or not streaming_holdback else max(c.sent_text, len(c.text) - c.holdback)
            logprobs = r.output_logprobs if r.sampling_params.logprobs is not None else None
            outputs.append(CompletionOutput(
                index=c.index, text=c.text[:visible], token_ids=list(r.output_token_ids),
                finish_reason=r.status.finish_reason, stop_reason=r.stop_reason, logprobs=logprobs,
                delta_text=c.text[c.sent_text:visible],
                delta_token_ids=r.output_token_ids[c.sent_tokens:],
                delta_logprobs=None if logprobs is None else logprobs[c.sent_tokens:]))
            c.sent_text, c.sent_tokens = visible, len(r.output_token_ids)
        first = self.children[0].request
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=first.prompt_token_ids,
            outputs=outputs, finished=self.finished, num_cached_tokens=first.num_cached_tokens,
            arrival_time=self.arrival_time, first_token_time=first.first_token_time,
            queue_time=None if first.first_scheduled_time is None else first.first_scheduled_time - self.arrival_time)


def now() -> float:
    return time.monotonic()
