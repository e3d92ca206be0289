"""What crosses between the engine's front (tokenizer, detokenizer, streams) and its core (scheduler,
KV manager, model runner): plain data, encoded with msgspec. Both placements of the core, on a thread
of this process or in a process of its own, exchange exactly these messages, one per step each way.

Front -> core: `EngineCoreRequest` (a new sequence: its token ids and sampling parameters, once) and
`AbortRequests` (ids to end: a client that left, or a stop string the front's detokenizer found).
Core -> front: `EngineCoreOutputs`, one per step: each sequence's new token (with logprobs), its
finish reason once it ends, and the scheduler's counters.
"""
from __future__ import annotations

import msgspec
import numpy as np
import torch

from splitserve.protocol.lora import LoRARequest
from splitserve.protocol.mm_inputs import ImageItem
from splitserve.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    max_total_tokens: int          # prompt + output cap (the model's context, or prompt + max_tokens)
    arrival_time: float
    mm_items: tuple[ImageItem, ...] = ()
    lora_request: LoRARequest | None = None
    priority: int = 0              # --scheduling-policy priority: lower runs first
    # Encoder-decoder models: the encoder's token ids (images: mm_items) and its positions; the
    # prompt_token_ids are then the decoder's (its start token).
    encoder_prompt_ids: list[int] = []
    num_encoder_tokens: int = 0
    # sampling_params.bad_words as token-id sequences (each word with and without a leading space),
    # made by the front, which holds the tokenizer; the worker bans them (worker/input_batch.py).
    bad_words_token_ids: list[list[int]] = []


class AbortRequests(msgspec.Struct, array_like=True, tag=True):
    request_ids: list[str]
    # "abort" (the client went away, the server drains) or "stop" (a stop string ended it)
    reason: str = "abort"


class AddRequests(msgspec.Struct, array_like=True, tag=True):
    requests: list[EngineCoreRequest]


class Shutdown(msgspec.Struct, array_like=True, tag=True):
    pass


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    # Per new token: {token_id: logprob}, the sampled token first, then the top k.
    new_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0         # prompt tokens found in the prefix cache at admission
    queue_time: float | None = None    # seconds from arrival to first scheduling (first output only)
    new_logprob_ranks: list[int] | None = None  # per new token with logprobs: its rank (1: the likeliest)
    # With the first token of a request that asked for them: per prompt token after the first, its
    # {token_id: logprob} (the prompt token first, then the top k) and the prompt token's rank.
    prompt_logprobs: list[dict[int, float]] | None = None
    prompt_logprob_ranks: list[int] | None = None
    # With the last output of a request a KV producer holds blocks for: vLLM's kv_transfer_params
    # (remote_engine_id, remote_host, remote_port, remote_block_ids, remote_request_id, ...).
    kv_transfer_params: dict | None = None
    # With a request's first token, when the TTFT breakdown is on (SPLITSERVE_TTFT_LOG): the core's
    # timestamps of it (ttft_trace.CoreTracer.first_token).
    ttft_trace: list[float] | None = None


class KVTransferCounters(msgspec.Struct, array_like=True):
    """A KV connector's running totals (kv_transfer/base.py KVTransferStats)."""
    sent_tokens: int = 0
    sent_bytes: int = 0
    recv_tokens: int = 0
    recv_bytes: int = 0
    failed: int = 0
    time_buckets: list[int] = []  # per bucket of kv_transfer.base.TRANSFER_TIME_BUCKETS, then +Inf
    time_sum: float = 0.0
    offload_saved_blocks: int = 0
    offload_hit_tokens: int = 0


class SchedulerStats(msgspec.Struct, array_like=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_preemptions: int = 0
    num_received: int = 0   # sequences the core has taken in (the front counts those it sent)
    num_receiving: int = 0  # waiting for their prompt's KV from another engine
    num_held: int = 0       # finished requests whose blocks a producer holds for a remote reader
    prompt_tokens_computed: int = 0  # prompt tokens run by steps (not prefix-cached, not loaded)
    kv_transfer: KVTransferCounters | None = None
    # Speculative decoding (vLLM's spec_decode counters): sequences that verified drafts, their draft
    # tokens, the accepted ones, and accepted drafts by position (0 = the first draft).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []


class EngineCoreOutputs(msgspec.Struct, array_like=True, tag=True):
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    timestamp: float                 # time.monotonic() when the step's tokens were known
    dead: str | None = None          # the core cannot go on: why (the last message it sends)
    # Tokens run by each step launched since the previous message (one entry a step, usually one).
    step_tokens: list[int] = []
    # With `dead`: a process of the engine (a worker rank) is gone or hung, and the core exits too; the
    # front then fails everything and exits as when it loses the core process itself.
    process_lost: bool = False


class CoreReady(msgspec.Struct, array_like=True, tag=True):
    """The core's first message: it is built, and what the front needs to validate requests."""
    num_blocks: int
    block_size: int
    error: str | None = None         # start-up failed: the message of the exception


FrontToCore = AddRequests | AbortRequests | Shutdown
CoreToFront = EngineCoreOutputs | CoreReady

# Tensors (images' pixels, LoRA slot loads' weights) travel as msgpack extensions: dtype name, shape,
# raw bytes.
_TENSOR_EXT = 1


def _enc_hook(obj):
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return msgspec.msgpack.Ext(_TENSOR_EXT, msgspec.msgpack.encode((str(t.dtype).removeprefix("torch."),
                                                                       list(t.shape), raw)))
    raise NotImplementedError(f"cannot send {type(obj).__name__} to the engine core")


def _ext_hook(code: int, data: memoryview):
    if code == _TENSOR_EXT:
        dtype, shape, raw = msgspec.msgpack.decode(data)
        dtype = getattr(torch, dtype)
        if not raw:
            return torch.empty(shape, dtype=dtype)
        return torch.from_numpy(np.frombuffer(bytearray(raw), dtype=np.uint8)).view(dtype).reshape(shape)
    raise ValueError(f"unknown msgpack extension {code}")


def _dec_hook(type_, obj):
    if type_ is torch.Tensor and isinstance(obj, torch.Tensor):
        return obj
    raise NotImplementedError(f"cannot decode {type_}")


class Codec:
    """msgpack encoder/decoder pair for one direction of the seam."""

    def __init__(self, decode_type):
        self.encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self.decoder = msgspec.msgpack.Decoder(decode_type, ext_hook=_ext_hook, dec_hook=_dec_hook)

    def encode(self, msg) -> bytes:
        return self.encoder.encode(msg)

    def decode(self, data):
        return self.decoder.decode(data)
