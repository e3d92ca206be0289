"""Every splitserve custom op (torch.library) and its fake (meta) implementation, in one place.

A custom op is the cut torch.compile and CUDA graphs see: one opaque call whose Python inside (a
branch on the token count, Triton launches with split-K counters, the attention backend reading the
step's metadata) never becomes a guard or part of a traced graph. The fake implementation gives the
compiler the output's shape and dtype without running anything.

    splitserve::attention            the batchless attention of one layer (body: attention/layer.py)
    splitserve::cross_attention      decoder queries over the encoder K/V (body: attention/cross.py)
    splitserve::lora_add_            the LoRA delta added in place (kernels/lora/lora_add.py)
    splitserve::fused_moe            the routed experts (kernels/moe/fused_moe.py)
    splitserve::fp8_linear           FP8 W8A8 / W8A16 linear (kernels/gemm/fp8/fp8_gemm.py)
    splitserve::silu_mul_fp8_linear  silu(gate) * up quantized to FP8, then the GEMM (gemm/act_quant.py)
    splitserve::int8_linear          INT8 W8A8 linear (kernels/gemm/int8/int8_gemm.py)
    splitserve::silu_mul_int8_linear silu(gate) * up quantized to INT8, then the GEMM (gemm/act_quant.py)
    splitserve::wna16_linear         weight-only int4 / int8 linear (kernels/gemm/wna16/wna16_gemm.py)

(The collectives splitserve::all_reduce / all_gather are parallel/communication.py's: that room is
below this one.)

The schemas are part of the engine's interface: CUDA graphs, torch.compile caches and ONNX export name
these ops, so a signature here changes only with all of them.

Importing this module imports no kernel, Triton or Gluon: each body imports its kernel module when it
first runs. The attention bodies live above this room (they read the forward context of
attention/layer.py and call the attention backend), so attention/layer.py and attention/cross.py bind
them with `implement` when they are imported; calling the op before that raises.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

_bodies: dict[str, Callable] = {}


def implement(name: str, body: Callable) -> None:
    """Binds the body of an op whose implementation lives above kernels/ ("attention",
    "cross_attention"); the op calls body(*args) with its own arguments."""
    if name not in ("attention", "cross_attention"):
        raise ValueError(f"splitserve::{name} has its body here; only the attention ops are bound from above")
    _bodies[name] = body


def _body(name: str) -> Callable:
    body = _bodies.get(name)
    if body is None:
        raise RuntimeError(f"splitserve::{name} has no body: import splitserve.attention.layer "
                           f"(and splitserve.attention.cross) first")
    return body


# -- attention -------------------------------------------------------------------------------------
# The op writes the step's K/V into kv_cache, yet declares no mutation: nothing else in a graph reads
# the cache, and a declared mutation would make the compiler functionalize (copy) a multi-GB tensor.
# The cache is an argument (not looked up by layer index) so every decoder layer traces to the same
# graph and compiles once.
# k_scale / v_scale are the layer's FP8 KV scales (device tensors, so a checkpoint's values need no
# recompile and CUDA graphs read them at replay); backends use them only when the cache is FP8.
# sliding_window / soft_cap: the layer's window and logit soft cap, 0 for none (plain numbers keep the
# op's schema simple; the backends take None).
@torch.library.custom_op("splitserve::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 k_scale: torch.Tensor, v_scale: torch.Tensor, positions: torch.Tensor,
                 cos_sin: torch.Tensor | None, num_heads: int, num_kv_heads: int, scale: float,
                 sliding_window: int = 0, soft_cap: float = 0.0,
                 pos_bias: torch.Tensor | None = None) -> torch.Tensor:
    return _body("attention")(q, k, v, kv_cache, k_scale, v_scale, positions, cos_sin, num_heads, num_kv_heads,
                              scale, sliding_window, soft_cap, pos_bias)


@attention_op.register_fake
def _(q, k, v, kv_cache, k_scale, v_scale, positions, cos_sin, num_heads, num_kv_heads, scale,
      sliding_window=0, soft_cap=0.0, pos_bias=None):
    return q.new_empty(q.shape)


@torch.library.custom_op("splitserve::cross_attention", mutates_args=())
def cross_attention_op(q: torch.Tensor, kv_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                       scale: float) -> torch.Tensor:
    return _body("cross_attention")(q, kv_cache, num_heads, num_kv_heads, scale)


@cross_attention_op.register_fake
def _(q, kv_cache, num_heads, num_kv_heads, scale):
    return q.new_empty(q.shape)


# -- LoRA ------------------------------------------------------------------------------------------
@torch.library.custom_op("splitserve::lora_add_", mutates_args=("out",))
def lora_add_(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
              num_tiles: torch.Tensor, token_slots: torch.Tensor, tile_slots: torch.Tensor,
              token_rows: torch.Tensor, shard_sizes: list[int], rank: int) -> None:
    from splitserve.kernels.lora.lora_add import lora_add_impl  # Triton only once the kernels run
    lora_add_impl(out, x, lora_a, lora_b, num_tiles, token_slots, tile_slots, token_rows, shard_sizes, rank)


@lora_add_.register_fake
def _(out, x, lora_a, lora_b, num_tiles, token_slots, tile_slots, token_rows, shard_sizes, rank) -> None:
    return None


# -- MoE -------------------------------------------------------------------------------------------
# Opaque for the compiler: the kernels' configuration is a Python choice by the token count (which
# Dynamo must not turn into a guard per size) and the launches are Triton's. Functional (no declared
# mutation), so compiled regions and CUDA graphs can hold it.
@torch.library.custom_op("splitserve::fused_moe", mutates_args=())
def fused_moe_op(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
    from splitserve.kernels.moe.fused_moe import fused_moe
    return fused_moe(x, w13, w2, topk_weights, topk_ids)


@fused_moe_op.register_fake
def _(x, w13, w2, topk_weights, topk_ids):
    return x.new_empty((x.shape[0], w13.shape[2]))


# -- quantized linear layers -----------------------------------------------------------------------
def _opaque_linear_op(name: str, fn: Callable[[], Callable]):
    """`fn()(x, w, w_scale, bias) -> [rows of x, w.shape[0]]` registered as the custom op
    `splitserve::<name>`: one opaque call for torch.compile, so the Python branch on the token count
    inside the kernel's dispatcher never becomes a guard per size, and its Triton launches (split-K
    counters) stay out of the traced graph. fn returns the dispatcher (imported when first called)."""
    def call(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fn()(x, w, w_scale, bias)

    op = torch.library.custom_op(f"splitserve::{name}", call, mutates_args=())
    op.register_fake(lambda x, w, w_scale, bias: x.new_empty((x.shape[0], w.shape[0])))
    return op


def _fp8_linear():
    from splitserve.kernels.gemm.fp8.fp8_gemm import fp8_linear
    return fp8_linear


def _silu_mul_fp8_linear():
    from splitserve.kernels.gemm.act_quant import silu_mul_fp8_linear
    return silu_mul_fp8_linear


def _silu_mul_int8_linear():
    from splitserve.kernels.gemm.act_quant import silu_mul_int8_linear
    return silu_mul_int8_linear


# fp8_linear picks a kernel by the token count; silu_mul_fp8_linear fuses silu·mul into the per-token
# quantization (gemm/act_quant.py) before the GEMM.
fp8_linear_op = _opaque_linear_op("fp8_linear", _fp8_linear)
silu_mul_fp8_linear_op = _opaque_linear_op("silu_mul_fp8_linear", _silu_mul_fp8_linear)
silu_mul_int8_linear_op = _opaque_linear_op("silu_mul_int8_linear", _silu_mul_int8_linear)


# The kernels pick tiles by the token count (a Python branch that Dynamo must not turn into a guard
# per size) and may use split-K counters.
@torch.library.custom_op("splitserve::int8_linear", mutates_args=())
def int8_linear_op(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                   input_scale: torch.Tensor | None) -> torch.Tensor:
    from splitserve.kernels.gemm.int8.int8_gemm import int8_linear
    return int8_linear(x, w, w_scale, bias, input_scale=input_scale)


@int8_linear_op.register_fake
def _(x, w, w_scale, bias, input_scale):
    return x.new_empty((x.shape[0], w.shape[0]))


# wna16_linear branches on the token count and launches Triton kernels with split-K counters.
@torch.library.custom_op("splitserve::wna16_linear", mutates_args=())
def wna16_linear_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    perm: torch.Tensor | None, bias: torch.Tensor | None, bits: int, group_size: int) -> torch.Tensor:
    from splitserve.kernels.gemm.wna16.wna16_gemm import wna16_linear
    return wna16_linear(x, qweight, scales, zeros, bits=bits, group_size=group_size, perm=perm, bias=bias)


@wna16_linear_op.register_fake
def _(x, qweight, scales, zeros, perm, bias, bits, group_size):
    return x.new_empty((x.shape[0], qweight.shape[1]))
