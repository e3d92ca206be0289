"""The worker's side of LoRA: slot loads from the step message, and each step's token -> slot layout.

A slot load (`LoRASlotLoad`) carries the adapter's whole weights; each wrapper copies in its layer's
part (a tensor-parallel rank its shard, a pipeline stage only its layers: lora/layers.py). Nothing
is asked of the core: the same code serves a runner in the core's process and every rank process.

The persistent batch keeps each request's adapter id per row (`InputBatch.lora_id`, 0: none). Per
step the runner calls `prepare_step` with the step's rows and token counts: it maps ids to slots (the
scheduler guarantees every scheduled adapter is in a slot), writes the step's layout (kernels/lora/lora_add.py)
into a pinned host copy and copies it into the model's static layout buffer on the step's stream (no
reallocation, no wait), and sets the wrappers' flag. A step with no adapter leaves the flag off and,
once the device layout is empty, copies nothing: it costs nothing more than without LoRA.
"""
from __future__ import annotations

import numpy as np
import torch

from splitserve.config import EngineConfig
from splitserve.kernels.lora.lora_add import LoRALayout, fill_layout
from splitserve.lora.layers import LoRAModel, attach_lora


class LoRAWorker:
    def __init__(self, lora_model: LoRAModel):
        self.model = lora_model
        self.slot_of: dict[int, int] = {}
        self.active = False
        layout = lora_model.layout
        self.device_layout = layout
        cuda = layout.buffer.is_cuda
        # Two host copies, used in turn: a copy may still be in flight from one while the next step
        # writes the other. A copy is reused only after the event recorded behind its transfer.
        self._host = [LoRALayout(layout.max_tokens, layout.max_loras, "cpu", pin=cuda) for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._device_empty = True  # the device layout has no tile and every token slot is -1

    def apply_loads(self, loads) -> None:
        for load in loads:
            for lid, slot in list(self.slot_of.items()):
                if slot == load.slot:
                    del self.slot_of[lid]
            self.model.set_slot(load.slot, {(m.layer, m.proj): (m.a, m.b) for m in load.modules})
            self.slot_of[load.lora_int_id] = load.slot

    def prepare_step(self, row_lora_ids: np.ndarray, counts: np.ndarray) -> bool:
        """Writes the step's layout from each scheduled row's adapter id and token count; returns (and
        sets the wrappers' flag to) whether any token has an adapter."""
        active = bool(row_lora_ids.any())
        self.active = self.model.state.active = active
        if not active and self._device_empty:
            return False
        token_slots = np.full(0, -1, dtype=np.int64)
        if active:
            slot_of = self.slot_of
            row_slots = np.fromiter((slot_of[i] if i else -1 for i in row_lora_ids.tolist()), dtype=np.int64,
                                    count=len(row_lora_ids))
            token_slots = np.repeat(row_slots, counts)
        self._write(token_slots)
        self._device_empty = not active
        return active

    def _write(self, token_slots: np.ndarray) -> None:
        i = self._turn
        self._turn ^= 1
        if self._copied[i] is not None:
            self._copied[i].synchronize()  # done long ago in practice: two steps back
        host = self._host[i]
        num_tiles = fill_layout(host, token_slots)
        n = host.used_len(num_tiles)
        dev = self.device_layout.buffer
        dev[:n].copy_(host.buffer[:n], non_blocking=dev.is_cuda)
        if dev.is_cuda:
            event = self._copied[i] or torch.cuda.Event()
            event.record()
            self._copied[i] = event


def build_worker(config: EngineConfig, model) -> LoRAWorker:
    """With --enable-lora: the worker's side, attached to the built model (this rank's part of it;
    before it is compiled)."""
    lora = config.lora
    # The layout covers a step's token budget and a decode graph's padded batch (at most max_num_seqs).
    max_tokens = max(config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs)
    return LoRAWorker(attach_lora(model, lora.max_loras, lora.max_rank, max_tokens))
