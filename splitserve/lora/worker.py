"""The worker's side of LoRA: slot loads from the step message, and each step's token -> slot layout.

The persistent batch keeps each request's adapter id per row (`InputBatch.lora_id`, 0: none). Per
step the runner asks `prepare_step` with the step's rows and token counts: it maps ids to slots (the
scheduler guarantees every scheduled adapter is in a slot), builds the grouped layout
(lora/ops.LoRABatch) and turns the wrappers on; with no adapter in the step they stay off and the step
costs nothing more than without LoRA.
"""
from __future__ import annotations

import numpy as np

from splitserve.lora.layers import LoRAModel
from splitserve.lora.ops import build_lora_batch, set_lora_batch


class LoRAWorker:
    def __init__(self, lora_model: LoRAModel, host_adapter):
        """host_adapter(lora_int_id, path) -> LoRAAdapter: the engine core's loaded weights."""
        self.model = lora_model
        self.host_adapter = host_adapter
        self.slot_of: dict[int, int] = {}
        self.active = False

    def apply_loads(self, loads) -> None:
        for load in loads:
            for lid, slot in list(self.slot_of.items()):
                if slot == load.slot:
                    del self.slot_of[lid]
            self.model.set_slot(load.slot, self.host_adapter(load.lora_int_id, load.lora_path))
            self.slot_of[load.lora_int_id] = load.slot

    def prepare_step(self, row_lora_ids: np.ndarray, counts: np.ndarray, device) -> bool:
        """Sets the step's layout from each scheduled row's adapter id and token count; returns whether
        any token has an adapter."""
        batch = None
        if row_lora_ids.any():
            slot_of = self.slot_of
            row_slots = np.fromiter((slot_of[i] if i else -1 for i in row_lora_ids.tolist()), dtype=np.int64,
                                    count=len(row_lora_ids))
            batch = build_lora_batch(np.repeat(row_slots, counts), device)
        set_lora_batch(batch)
        self.active = self.model.state.active = batch is not None
        return self.active
