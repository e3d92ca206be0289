"""The batchless cut: one custom op per attention layer.

Everything around this op is batchful (runs on the flat token stream). The op itself reads the step's
attention metadata and KV caches from the forward context, which is set once per step by the model
runner. The context is the one module-level "current batch" state: it exists because a compiled graph
cannot take the per-step metadata through the op's arguments without recompiling.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from splitserve.attention.backend import AttentionBackend, AttentionMetadata
from splitserve.kernels.ops import attention_op, implement


@dataclass
class ForwardContext:
    meta: AttentionMetadata
    backend: AttentionBackend


_context: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext):
    global _context
    prev, _context = _context, ctx
    try:
        yield
    finally:
        _context = prev


def current_context() -> ForwardContext | None:
    """The step's context (None outside a forward): for a runtime that calls back into the op's body
    from outside torch (attention/onnx_plugin.py)."""
    return _context


def _attention(q, k, v, kv_cache, k_scale, v_scale, positions, cos_sin, num_heads, num_kv_heads, scale,
               sliding_window=0, soft_cap=0.0, pos_bias=None):
    """The body of the op splitserve::attention (registered with its schema and fake in kernels/ops.py):
    the backend's forward on the step's metadata."""
    ctx = _context
    if ctx is None:
        raise RuntimeError("attention called outside a forward context")
    T = q.shape[0]
    head_dim = q.shape[1] // num_heads
    out = ctx.backend.forward(q.view(T, num_heads, head_dim), k.view(T, num_kv_heads, head_dim),
                              v.view(T, num_kv_heads, head_dim), kv_cache, ctx.meta, scale, positions, cos_sin,
                              k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window or None,
                              soft_cap=soft_cap or None, **({} if pos_bias is None else {"pos_bias": pos_bias}))
    return out.reshape(T, num_heads * head_dim)


implement("attention", _attention)  # the body of splitserve::attention (kernels/ops.py)


class Attention(nn.Module):
    """Rotate q/k (with a rotary table) + store K/V + attend, for all sequences of the step; q/k/v are
    [T, heads * head_dim], possibly strided views of one QKV projection.

    sliding_window: this layer's window W (a query at position p sees keys p - W < n <= p); None: full
    causal attention. soft_cap: logits become soft_cap * tanh(logits / soft_cap) (Gemma 2); None: off.
    Both are per layer, so a model may alternate local and global layers."""

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 rotary: nn.Module | None = None, sliding_window: int | None = None,
                 soft_cap: float | None = None):
        super().__init__()
        if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                           or sliding_window < 1):
            raise ValueError(f"layer {layer_idx}: sliding_window must be a positive integer or None, "
                             f"got {sliding_window!r}")
        if soft_cap is not None and not (isinstance(soft_cap, (int, float)) and 0 < soft_cap < float("inf")):
            raise ValueError(f"layer {layer_idx}: soft_cap must be a positive finite number or None, got {soft_cap!r}")
        self.layer_idx, self.num_heads, self.num_kv_heads = layer_idx, num_heads, num_kv_heads
        self.head_dim, self.scale = head_dim, scale
        self.sliding_window = sliding_window
        self.soft_cap = None if soft_cap is None else float(soft_cap)
        self.rotary = rotary  # a RotaryEmbedding (its cos_sin table), shared by the model's layers
        # This layer's paged cache [num_blocks, 2, block_size, num_kv_heads, head_dim]; bound by the
        # model runner once memory is sized. A buffer, so compiled graphs take it as an input.
        self.register_buffer("kv_cache", torch.empty(0), persistent=False)
        # Per-tensor FP8 scales of this layer's cached K and V (stored = x / scale, read = stored *
        # scale), from the checkpoint when it has them (load_kv_scale), else 1.0. Always fp32,
        # whatever the model's dtype; unused unless the cache is FP8.
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        # T5's relative position bias, [num_heads, max_len] fp32 indexed by query - key distance; set
        # by the model after loading (None: none). See AttentionBackend.forward.
        self.register_buffer("pos_bias", None, persistent=False)

    def load_kv_scale(self, which: str, tensor: torch.Tensor) -> None:
        """Sets k_scale or v_scale (`which`) from a checkpoint tensor holding one positive value."""
        if tensor.numel() != 1:
            raise ValueError(f"layer {self.layer_idx}: {which} must be one per-tensor value, got shape "
                             f"{tuple(tensor.shape)} (per-head or per-channel KV scales are not supported)")
        value = float(tensor.float().reshape(()))
        if not (value > 0 and value != float("inf")):
            raise ValueError(f"layer {self.layer_idx}: {which} must be a positive finite number, got {value}")
        getattr(self, which).fill_(value)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos_sin = None if self.rotary is None else self.rotary.cos_sin
        if q.device.type == "cpu" and not torch.compiler.is_compiling():
            # Eager on CPU there is no graph to cut: the body directly, without the custom op's
            # dispatch (Python, about 0.1 ms a call: 3 ms a step of a 30-layer model). Same result.
            return _attention(q, k, v, self.kv_cache, self.k_scale, self.v_scale, positions, cos_sin,
                              self.num_heads, self.num_kv_heads, self.scale, self.sliding_window or 0,
                              self.soft_cap or 0.0, self.pos_bias)
        if self.pos_bias is not None:
            return attention_op(q, k, v, self.kv_cache, self.k_scale, self.v_scale, positions, cos_sin,
                                self.num_heads, self.num_kv_heads, self.scale, self.sliding_window or 0,
                                self.soft_cap or 0.0, self.pos_bias)
        return attention_op(q, k, v, self.kv_cache, self.k_scale, self.v_scale, positions, cos_sin,
                            self.num_heads, self.num_kv_heads, self.scale, self.sliding_window or 0,
                            self.soft_cap or 0.0)


def kv_free_window(model: nn.Module) -> int | None:
    """The window after which the KV manager may free a sequence's blocks: the largest of the model's
    per-layer windows when every Attention layer has one; None (free nothing early) when any layer
    attends over the whole context, or the model has no Attention layer."""
    windows = [m.sliding_window for m in model.modules() if isinstance(m, Attention)]
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)


# How checkpoints name a layer's KV-cache scales (the prefix before ".self_attn." is kept), and which
# of the Attention module's scales each fills. vLLM reads the same names: compressed-tensors writes
# self_attn.{k,v}_scale (older versions: the k/v projections' output_scale), NVIDIA ModelOpt
# self_attn.{k,v}_proj.{k,v}_scale, and early FP8 checkpoints one self_attn.kv_scale for both.
_KV_SCALE_NAMES = {
    "k_scale": ("k_scale",), "v_scale": ("v_scale",),
    "attn.k_scale": ("k_scale",), "attn.v_scale": ("v_scale",),
    "k_proj.k_scale": ("k_scale",), "v_proj.v_scale": ("v_scale",),
    "k_proj.output_scale": ("k_scale",), "v_proj.output_scale": ("v_scale",),
    "kv_scale": ("k_scale", "v_scale"),
}


def kv_scale_targets(name: str, attn_module: str = "attn") -> list[tuple[str, str]]:
    """For a checkpoint tensor name that is a KV-cache scale, [(Attention module path, "k_scale" or
    "v_scale")], e.g. "layers.3.self_attn.k_proj.output_scale" -> [("layers.3.self_attn.attn",
    "k_scale")]; [] for any other name. attn_module: the Attention module's name in self_attn."""
    prefix, sep, rest = name.rpartition(".self_attn.")
    if not sep or rest not in _KV_SCALE_NAMES:
        return []
    return [(f"{prefix}.self_attn.{attn_module}", which) for which in _KV_SCALE_NAMES[rest]]
