"""The step message from the scheduler to the worker: plain data, never live objects.

One `SchedulerOutput` per step. It carries a request's full data once, when the worker first sees it
(`NewRequestData`), and afterwards only what changed: how many tokens each request runs this step
(`num_scheduled_tokens`, in batch order), blocks appended to running requests' block tables
(`CachedRequestData`), the ids that left the running batch since the last message (finished: stop,
length, abort, error; preempted: blocks freed, to be recomputed), and preempted requests scheduled
again (`ResumedRequestData`). The worker keeps everything else in its persistent batch
(worker/input_batch.py): token ids (prompt and the tokens it sampled itself), block tables, sampling
state. Structs are msgspec's, so a message can be encoded once and broadcast to several worker
processes (protocol.core_messages.Codec handles the image tensors of multimodal items).

Images of waiting requests are announced once (`mm_prefetch`), before their admission, so the
worker may encode them ahead; a request aborted while waiting after that is reported finished too.
The worker keeps what was announced until the request arrives as new (`NewRequestData.mm_prefetched`:
its items are not sent again) or is reported finished. So announcements go only in messages the
worker gets (a step that runs something or carries removals), and a message that failed to reach it
has its announcements made again.

Resumption: a preempted request stays known to the worker (its tokens, its seeded generator), out of
the batch. When it is scheduled again, `ResumedRequestData` gives its new block table (replacing the
freed one) and its new num_computed_tokens (prefix-cache hits at re-admission, else 0); the worker
recomputes the rest from the tokens it holds.

Structured outputs: when constrained requests sample in a step, `grammar` carries one token bitmask
row per such request (bit t of a row: token t is allowed), filled by the core from their grammar
matchers; the worker masks those rows' logits on the device. None in every other step. A runner in the
core's own process gets the rows first and the masks after the forward is enqueued (see GrammarBitmask).

The worker applies a message in this order: finished, preempted, new, resumed, block additions; then
runs `num_scheduled_tokens` (the encoders of `encoder_runs` first). Removals are idempotent (an unknown id is ignored), so a message whose
step failed to launch can have its removals sent again with the next one.
"""
from __future__ import annotations

import msgspec
import torch

from splitserve.protocol.lora import LoRASlotLoad
from splitserve.protocol.mm_inputs import ImageItem
from splitserve.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request the worker has not seen: everything it needs, sent once."""
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int = 0       # prefix-cache hits at admission
    eos_token_ids: tuple[int, ...] = ()  # banned while under min_tokens (unless ignore_eos)
    mm_items: tuple[ImageItem, ...] = ()
    # Its images were announced in an earlier message's mm_prefetch (under this req_id): mm_items is
    # then empty and the worker takes the items it already holds, so each image's pixels cross once.
    mm_prefetched: bool = False
    lora_id: int = 0                   # its LoRA adapter's int id (0: none); the slot comes from lora_loads
    encoder_prompt_ids: list[int] = []  # encoder-decoder models: the encoder's token ids (T5)
    num_encoder_tokens: int = 0        # encoder positions (0: decoder-only)
    bad_words_token_ids: list[list[int]] = []  # the front's tokenization of sampling_params.bad_words


class ResumedRequestData(msgspec.Struct, array_like=True):
    """A preempted request scheduled again: its whole new block table and where computing resumes."""
    req_id: str
    block_ids: list[int]
    num_computed_tokens: int


class CachedRequestData(msgspec.Struct, array_like=True):
    """Running requests whose block table grew this step (columns: req_ids[i] gains new_block_ids[i])."""
    req_ids: list[str] = []
    new_block_ids: list[list[int]] = []


class GrammarBitmask(msgspec.Struct, array_like=True):
    """Allowed next tokens of the constrained requests that sample this step: row i of `bitmask`
    ([len(req_ids), ceil(vocab / 32)] int32, bit t % 32 of word t // 32) belongs to req_ids[i].
    bitmask None: the masks follow the launch (`ModelRunner.sample`, a runner in the core's process),
    filled while the device runs the forward. Messages to worker processes always carry them."""
    req_ids: list[str]
    bitmask: torch.Tensor | None = None


class SchedulerOutput(msgspec.Struct, array_like=True):
    step_id: int = 0
    # Tokens each request runs this step, in batch order (dicts keep insertion order, msgpack too).
    num_scheduled_tokens: dict[str, int] = {}
    total_num_scheduled_tokens: int = 0
    new_requests: list[NewRequestData] = []
    resumed_requests: list[ResumedRequestData] = []
    cached_requests: CachedRequestData = msgspec.field(default_factory=CachedRequestData)
    finished_req_ids: list[str] = []   # left for good since the last message
    preempted_req_ids: list[str] = []  # blocks freed since the last message; the worker keeps their state
    grammar: GrammarBitmask | None = None  # structured outputs: masks of the constrained rows that sample
    # LoRA adapters (with their weights) to put into GPU slots before this step runs: one entry per
    # slot assignment, so in the few steps that admit a request whose adapter is not in a slot.
    lora_loads: list[LoRASlotLoad] = []
    # Encoder-decoder models: requests whose encoder runs in this step (admitted, or resumed after a
    # preemption) -> their cross block ids; the worker writes the encoder K/V there before the decoder.
    encoder_runs: dict[str, list[int]] = {}
    # Vision-language models: images of requests still waiting, each announced once, so the worker can
    # encode them ahead, beside the steps before their admission (multimodal/step.py).
    mm_prefetch: dict[str, tuple[ImageItem, ...]] = {}
    # Speculative decoding: the draft tokens each verifying request runs after its last token (they
    # count in its num_scheduled_tokens); the worker proposed them at the end of an earlier step.
    spec_token_ids: dict[str, list[int]] = {}
    # Whether the worker proposes drafts from this step's tokens (for the next step): the scheduler's
    # adaptive plan (core/spec_control.py); proposing makes the step collected before the next launch.
    spec_propose: bool = False

    @property
    def is_empty(self) -> bool:
        """Nothing to run (the message may still carry removals)."""
        return not self.num_scheduled_tokens

    @property
    def has_removals(self) -> bool:
        return bool(self.finished_req_ids or self.preempted_req_ids)

    @property
    def has_updates(self) -> bool:
        """Something the worker must apply even when nothing runs: removals, or LoRA slot loads sent
        again after a launch that failed."""
        return self.has_removals or bool(self.lora_loads)
