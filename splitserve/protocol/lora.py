"""What names an adapter, as plain data that travels with a request (front -> core -> worker).

`LoRARequest(lora_name, lora_int_id, lora_path)` has vLLM's field names and order. The int id is the
adapter's identity everywhere inside the engine (slots, prefix-cache keys); 0 means "no adapter".
`LoRASlotLoad` (core -> worker, in the step message) carries an adapter's weights into a slot.
"""
from __future__ import annotations

import msgspec
import torch


class LoRARequest(msgspec.Struct, array_like=True, frozen=True):
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("LoRARequest: lora_name must not be empty")

    # vLLM's older accessors
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


class LoRAModuleWeights(msgspec.Struct, array_like=True):
    """One projection's adapter weights: A [r, in] and B [out, r] (the scaling folded into B), whole,
    as in the checkpoint: a tensor-parallel rank cuts its own part (lora/layers.py).

    Whole rather than cut for each rank by the core: the step message is encoded once and broadcast
    to every rank (cut parts would need a message per rank), and the core need not know how each
    rank cuts a layer (query heads, replicated KV heads, pipeline stages); each layer cuts its part
    the way it cut its checkpoint weights. The cost, every rank receiving the whole adapter, comes
    once per slot assignment."""
    layer: int        # the decoder layer's index in the whole model (a pipeline stage keeps its own)
    proj: str         # "q", "k", "v", "o", "gate", "up" or "down"
    a: torch.Tensor
    b: torch.Tensor


class LoRASlotLoad(msgspec.Struct, array_like=True):
    """Step message entry: before this step, put adapter `lora_int_id` into GPU slot `slot` (whatever
    was there is evicted). It carries the adapter's weights, so a worker (in the core's process or a
    rank process) loads the slot from the message alone; sent once per slot assignment, which is rare
    (a step whose adapters already sit in their slots carries none). Tensors travel as msgpack
    extensions (protocol/core_messages.Codec); in the core's own process they are the host copies
    themselves, not copied."""
    slot: int
    lora_int_id: int
    lora_path: str                             # where it was read from (messages, logs)
    modules: list[LoRAModuleWeights] = []
