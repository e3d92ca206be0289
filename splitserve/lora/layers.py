"""LoRA on the model's linear layers, attached after the model is built (`attach_lora`).

Each of q/k/v (the merged QKV layer), o, gate/up (merged) and down of every decoder layer is replaced
by a `LoRALinear` that runs the base layer unchanged and, when the step has tokens with an adapter,
adds their delta (kernels/lora/lora_add.py) into its output. The adapters live in fixed GPU slots: per layer
`lora_a` [max_loras, shards * max_rank, in] and `lora_b` [max_loras, out, max_rank], zero-padded to
--max-lora-rank, the scaling folded into B; a slot load copies into them in place. Every wrapper
reads the one step layout (`LoRALayout`, static device buffers the worker rewrites per step), so a
CUDA graph captured with the delta sees each step's tokens and slots without being captured again.

Tensor parallelism: a wrapper's slots hold this rank's part of each adapter, cut at the slot load
from the whole A and B the step message carries, by the base layer's own cut (`tp_output` /
`tp_input`, as the checkpoint loader cuts its weights). Column-parallel (q/k/v, gate/up): the rank
computes its output features, so B keeps the rows of those features (each shard's part, a replicated
KV head included) and A stays whole. Row-parallel (o, down): the rank holds its input features x_r,
so A keeps those columns and B stays whole; x_r A_r^T B^T is the rank's share of the delta, added to
the rank's partial output before the layer's one all-reduce, which then sums both (and the bias is
still added once, after it). Pipeline parallelism: a stage's wrappers know their layers' indices in
the whole model and take only those from the load.

Whether the forward calls the delta at all is one host-side flag shared by all the wrappers
(`LoRAState.active`): torch.compile guards on it, so the compiled halves exist in two variants, with
and without the op. The runner sets it from the step's layout for steps without graphs (a step with no
adapter runs exactly the base model); graph capture sets it per captured variant.
"""
from __future__ import annotations

import torch
from torch import nn

from splitserve.layers.linear import Linear
from splitserve.kernels import ops  # noqa: F401  (registers splitserve::lora_add_)
from splitserve.kernels.lora.lora_add import LoRALayout

# (layer, projection) -> (A [r, in], B [out, r]) of one adapter, whole (not cut for a rank)
AdapterWeights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


class LoRAState:
    """Shared by every wrapper of a model: whether the forward adds the LoRA delta."""

    def __init__(self):
        self.active = False


class LoRALinear(nn.Module):
    def __init__(self, base: Linear, projections: tuple[str, ...], layer_idx: int, state: LoRAState,
                 layout: LoRALayout, max_loras: int, max_rank: int):
        super().__init__()
        self.base = base
        self.projections = projections
        self.layer_idx = layer_idx
        self.state = state
        self.rank = max_rank
        if base.shard_offsets:
            self.shard_sizes = [size for _, size in base.shard_offsets.values()]
        else:
            self.shard_sizes = [base.out_features]
        if len(self.shard_sizes) != len(projections):
            raise ValueError(f"layer {layer_idx}: {len(self.shard_sizes)} shards for projections {projections}")
        # This rank's part of the adapters (set only with more than one tensor-parallel rank): per shard
        # the index of its part of B's rows (column-parallel), or of A's columns (row-parallel).
        tp_output = getattr(base, "tp_output", None)
        self.out_parts = [tp_output[name] for name in (base.shard_offsets or [None])] if tp_output else None
        self.in_part = getattr(base, "tp_input", None)
        device = next(base.parameters()).device
        dtype = base.params_dtype
        self.register_buffer("lora_a", torch.zeros(max_loras, len(projections) * max_rank, base.in_features,
                                                   dtype=dtype, device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, base.out_features, max_rank, dtype=dtype,
                                                   device=device), persistent=False)
        # The step layout's views, shared by every wrapper (buffers, so compiled code takes them as inputs).
        for name in ("num_tiles", "token_slots", "tile_slots", "token_rows"):
            self.register_buffer(name, getattr(layout, name), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_part is None:
            out = self.base(x)
            self._add_delta(out, x)
            return out
        # Row-parallel over several ranks: the delta of this rank's input features joins its partial
        # output, and the layer's all-reduce sums both (see the module docstring).
        out = self.base.partial_forward(x)
        self._add_delta(out, x)
        return self.base.reduce(out)

    def _add_delta(self, out: torch.Tensor, x: torch.Tensor) -> None:
        if self.state.active:
            torch.ops.splitserve.lora_add_(out, x, self.lora_a, self.lora_b, self.num_tiles, self.token_slots,
                                           self.tile_slots, self.token_rows, self.shard_sizes, self.rank)

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        return self.base.split(out)

    @property
    def is_quantized(self) -> bool:
        return self.base.is_quantized

    @property
    def params_dtype(self) -> torch.dtype:  # the activations' dtype (cuda_graphs sizes its buffers by it)
        return self.base.params_dtype

    @torch.no_grad()
    def set_slot(self, slot: int, weights: AdapterWeights | None) -> None:
        """Writes an adapter's weights for this layer (this rank's part) into a slot (zeros where it
        has none)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if not weights:
            return
        R, col = self.rank, 0
        for i, (proj, size) in enumerate(zip(self.projections, self.shard_sizes)):
            pair = weights.get((self.layer_idx, proj))
            if pair is not None:
                a, b = pair
                if self.in_part is not None:
                    a = a.narrow(1, self.in_part * self.base.in_features, self.base.in_features)
                if self.out_parts is not None:
                    b = b.narrow(0, self.out_parts[i] * size, size)
                r = a.shape[0]
                _copy_in(self.lora_a[slot, i * R:i * R + r], a)
                _copy_in(self.lora_b[slot, col:col + size, :r], b)
            col += size


def _copy_in(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Host -> device without waiting: a copy from pageable memory would synchronise the stream (and
    stall the steps in flight) once per tensor. The manager's adapters are pinned on the loader
    thread already (a runner in the core's process gets those very tensors); anything else (a rank
    process's decoded message, a rank's cut part) is pinned here (torch's host allocator keeps that
    copy until the transfer is done)."""
    if dst.is_cuda and src.device.type == "cpu":
        dst.copy_(src if src.is_pinned() else src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)


# attribute of the decoder layer's submodule -> the PEFT projections it stands for
_WRAPPED = (("self_attn", "qkv_proj", ("q", "k", "v")), ("self_attn", "o_proj", ("o",)),
            ("mlp", "gate_up_proj", ("gate", "up")), ("mlp", "down_proj", ("down",)))


class LoRAModel:
    """The wrappers of one model and the slots they share."""

    def __init__(self, state: LoRAState, layout: LoRALayout, wrappers: list[LoRALinear], max_loras: int,
                 max_rank: int):
        self.state = state
        self.layout = layout
        self.wrappers = wrappers
        self.max_loras = max_loras
        self.max_rank = max_rank

    def set_slot(self, slot: int, weights: AdapterWeights | None) -> None:
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot {slot} out of range (max_loras {self.max_loras})")
        for w in self.wrappers:
            w.set_slot(slot, weights)


def attach_lora(model: nn.Module, max_loras: int, max_rank: int, max_tokens: int) -> LoRAModel:
    """Replaces the decoder's projections with LoRA wrappers (after loading and
    process_weights_after_loading; before compilation). A VLM's language model gets them, its vision
    tower does not. max_tokens: the most flat tokens a forward sees (a step's budget, or a decode
    graph's padded batch if larger)."""
    if max_loras < 1 or max_rank < 1:
        raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras} and {max_rank}")
    # The decoder layers (models/interfaces.SupportsLoRA): a VLM's `layers` are its language model's.
    # Read here, not checked at load: lora/ sits below models/ and takes any module it is handed.
    layers = getattr(model, "layers", None)
    if not layers:
        raise ValueError(f"LoRA is not supported for {type(model).__name__}: it has no decoder layers")
    state = LoRAState()
    layout = LoRALayout(max_tokens, max_loras, next(model.parameters()).device)
    wrappers = []
    # A pipeline stage's layers keep their indices in the whole model (a VLM's are its language model's).
    first = getattr(getattr(model, "language_model", model), "start_layer", 0)
    for i, layer in enumerate(layers, start=first):
        for parent_name, attr, projections in _WRAPPED:
            parent = getattr(layer, parent_name, None)
            base = getattr(parent, attr, None)
            if not isinstance(base, Linear):
                raise ValueError(f"LoRA is not supported for {type(model).__name__}: layer {i} has no "
                                 f"{parent_name}.{attr} linear layer")
            wrapper = LoRALinear(base, projections, i, state, layout, max_loras, max_rank)
            setattr(parent, attr, wrapper)
            wrappers.append(wrapper)
    return LoRAModel(state, layout, wrappers, max_loras, max_rank)
