"""Multi-LoRA: many adapters of one base model served together, each token with its own adapter.

`protocol/lora.py` LoRARequest (plain data that travels with a request) and LoRASlotLoad (an
adapter's weights, in the step message, into a slot); `adapter.py` PEFT adapters read and checked
against the base model; `manager.py` the engine core's host LRU, loader thread and GPU slots;
`layers.py` the wrappers `attach_lora` puts on the decoder's projections; `worker.py` slot loads and
each step's token -> slot layout. The delta's kernels, layout and torch reference are kernels/lora/
(`lora_add.py`, `shrink_expand.py`); its custom op `splitserve::lora_add_` is kernels/ops.py's.
"""
from splitserve.protocol.lora import LoRARequest, LoRASlotLoad

__all__ = ["LoRARequest", "LoRASlotLoad"]
