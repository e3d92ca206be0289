"""The cross-attention op and layer: decoder queries over their request's encoder K/V.

Like the self-attention op (attention/layer.py) it is one custom op per layer, the cut between
batchful parts; its layout comes from the step's metadata (`AttentionMetadata.cross`, set by the
runner's encoder-decoder step: worker/encoder_decoder.py) through the forward context, and the
backend's `cross_forward` does the work. The K/V are not an input: they were stored once, when the
request's encoder ran (`CrossAttention.store`), in the layer's cache tensor, which the cross layer
shares with its decoder layer's self-attention (the two groups' blocks never overlap).
"""
from __future__ import annotations

import torch
from torch import nn

from splitserve.attention import layer as _layer
from splitserve.kernels.ops import cross_attention_op, implement


def _cross_attention(q, kv_cache, num_heads, num_kv_heads, scale):
    ctx = _layer._context
    if ctx is None or ctx.meta.cross is None:
        raise RuntimeError("cross-attention called outside a forward context with cross-attention metadata")
    T = q.shape[0]
    head_dim = q.shape[1] // num_heads
    out = ctx.backend.cross_forward(q.view(T, num_heads, head_dim), kv_cache, ctx.meta.cross, scale)
    return out.reshape(T, num_heads * head_dim)


implement("cross_attention", _cross_attention)  # the body of splitserve::cross_attention (kernels/ops.py)


class CrossAttention(nn.Module):
    """q [T, heads * head_dim] of the step's decoder tokens -> their attention over the encoder K/V.
    layer_idx: the decoder layer whose cache tensor holds this layer's cross blocks. With tensor
    parallelism the heads are this rank's (as its self-attention's, whose cache tensor it shares):
    its column-parallel q and k/v projections give them, its row-parallel output sums the ranks."""
    shares_layer_kv_cache = True  # the model runner binds kv_cache to decoder layer layer_idx's tensor

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.layer_idx, self.num_heads, self.num_kv_heads = layer_idx, num_heads, num_kv_heads
        self.head_dim, self.scale = head_dim, scale
        self.register_buffer("kv_cache", torch.empty(0), persistent=False)  # bound by the model runner

    def store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, backend) -> None:
        """Stores encoder K/V ([E, heads * head_dim] each) at their cross slots, once per request."""
        E = k.shape[0]
        backend.store_cross_kv(k.view(E, self.num_kv_heads, self.head_dim), v.view(E, self.num_kv_heads, self.head_dim),
                               self.kv_cache, slots)

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        if q.device.type == "cpu" and not torch.compiler.is_compiling():
            return _cross_attention(q, self.kv_cache, self.num_heads, self.num_kv_heads, self.scale)
        return cross_attention_op(q, self.kv_cache, self.num_heads, self.num_kv_heads, self.scale)
