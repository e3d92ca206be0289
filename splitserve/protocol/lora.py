"""What names an adapter, as plain data that travels with a request (front -> core -> worker).

`LoRARequest(lora_name, lora_int_id, lora_path)` has vLLM's field names and order. The int id is the
adapter's identity everywhere inside the engine (slots, prefix-cache keys); 0 means "no adapter".
"""
from __future__ import annotations

import msgspec


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


class LoRASlotLoad(msgspec.Struct, array_like=True):
    """Step message entry: before this step, put adapter `lora_int_id` (from `lora_path`) into GPU slot
    `slot` (whatever was there is evicted)."""
    slot: int
    lora_int_id: int
    lora_path: str
