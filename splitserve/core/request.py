"""Per-request state of the scheduler, the KV manager and the engine core. The worker never sees it:
it gets plain data in the step message (protocol/sched_output.py) and keeps its own per-request state
(worker/input_batch.py)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from splitserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # Its prompt's KV blocks are coming from another engine (a KV connector's load_async): it holds
    # its blocks and waits outside the queue, blocking no one, until the connector's poll says done.
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    FINISHED_STOPPED = "stop"      # EOS, stop token or stop string
    FINISHED_LENGTH = "length"     # max_tokens or the model's context
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


_FINISHED = frozenset(s for s in RequestStatus if s not in (RequestStatus.WAITING, RequestStatus.RUNNING,
                                                             RequestStatus.WAITING_FOR_REMOTE_KVS))


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_total_tokens: int = 0  # prompt + output cap (model context or prompt + max_tokens)
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # with the priority policy: lower runs first (vLLM's convention)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens sampled by launched steps whose values have not reached the host yet (async scheduling:
    # the next step is scheduled and launched before the previous one's tokens are read). They count
    # in num_tokens; their input ids are filled in on the device. 0 outside of overlapped stepping.
    num_pending: int = 0
    # Tokens whose K/V are in the cache (or about to be, for the step being run).
    num_computed_tokens: int = 0
    # Of those, how many came from the prefix cache at the last admission (for metrics).
    num_cached_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Hashes of this request's full blocks, in order; extended as blocks fill.
    block_hashes: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # The worker holds this request's state (it was sent as new and has not been reported finished);
    # a preempted request stays there, out of the batch, and is sent back as resumed.
    in_worker: bool = False
    # Its images were announced to the worker while it waited (SchedulerOutput.mm_prefetch).
    mm_announced: bool = False
    num_worker_blocks: int = 0  # leading block ids the worker has been sent
    stop_reason: int | str | None = None
    # Per-token logprob dicts of the output: [{token_id: logprob, ...}] (sampled token first).
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # prompt_logprobs: entry j is prompt token j + 1's {token_id: logprob} (itself first, then the top
    # k), gathered chunk by chunk until the first output token carries them to the front.
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprob_ranks: list[int] = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Images of a multimodal prompt (multimodal.inputs.ImageItem), sorted by placeholder offset.
    mm_items: tuple = ()
    # Structured outputs: its grammar's compile and matcher (structured_output.manager.RequestGrammar).
    grammar: object | None = None
    # LoRA: its adapter (lora.request.LoRARequest), and whether it holds the adapter's GPU slot.
    lora_request: object | None = None
    lora_pinned: bool = False
    # Encoder-decoder models: the encoder's input (token ids: T5; images come in mm_items), how many
    # encoder positions its cross-attention K/V hold (0: a decoder-only request), and the cross blocks
    # they sit in (the KV manager's second group; empty until admitted, freed with the request).
    encoder_prompt_ids: list[int] = field(default_factory=list)
    num_encoder_tokens: int = 0
    encoder_block_ids: list[int] = field(default_factory=list)
    # sampling_params.bad_words as token ids (the front's EngineCoreRequest.bad_words_token_ids),
    # passed on to the worker with NewRequestData.
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # KV transfer (kv_transfer/): vLLM's kv_transfer_params as the request brought them; what a
    # producer answers once it holds the blocks for a decode engine; whether a remote load was tried
    # (a failed one is not tried again: the request prefills here).
    kv_transfer_params: dict | None = None
    kv_params_out: dict | None = None
    kv_load_tried: bool = False

    # Speculative decoding: drafts the worker proposed for its next step (scheduled if they fit), and
    # how many tokens the last step's results gave it (several when drafts were accepted).
    spec_token_ids: list[int] = field(default_factory=list)
    num_new_tokens: int = 0

    # The TTFT breakdown's timestamps until its first token (ttft_trace.py); None when it is off.
    ttft_trace: list | None = None

    _encoder_hash: int | None = None

    @property
    def encoder_hash(self) -> int | None:
        """Identity of the encoder input: the decoder's blocks depend on it (through cross-attention),
        so it keys their prefix-cache hashes. None for a decoder-only request. Computed once."""
        if not self.num_encoder_tokens:
            return None
        if self._encoder_hash is None:
            self._encoder_hash = hash((tuple(self.encoder_prompt_ids), tuple(item.hash for item in self.mm_items)))
        return self._encoder_hash

    def add_prompt_logprobs(self, start: int, entries: list[dict[int, float]], ranks: list[int]) -> None:
        """Prompt logprobs of prompt tokens start + 1 ... from one computed chunk. A chunk computed
        again (after a preemption) replaces what it covers."""
        del self.prompt_logprobs[start:], self.prompt_logprob_ranks[start:]
        self.prompt_logprobs += entries
        self.prompt_logprob_ranks += ranks

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.num_pending

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output without building the whole list. Pending tokens
        read as 0 (the model runner fills them in on the device)."""
        known = self.num_known_tokens
        if end > known:
            return self.token_slice(start, known) + [0] * (end - max(start, known))
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED
