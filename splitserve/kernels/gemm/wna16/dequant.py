"""The in-register dequantization of a packed int4 / int8 weight tile, written once for the Triton
kernel (wna16_tiled.py) and the Gluon one (wna16_wgmma.py).

These are @triton.jit functions on triton.language: a Gluon kernel that calls one compiles it with
Gluon's semantics (Triton's code generator generates a callee with its caller's), and gl.join /
gl.reshape are the same builtins as tl.join / tl.reshape, so both kernels get the same operations
and the layouts Gluon infers for them. This module imports nothing of Gluon: the Triton kernel's
import does not depend on the experimental API.
"""
from __future__ import annotations

import triton
import triton.language as tl

F32_MAGIC_BITS = 0x4B000000  # fp32 2**23: OR-ing q < 2**23 into its mantissa gives exactly 2**23 + q
F32_MAGIC = tl.constexpr(8388608.0)


@triton.jit
def value(half, i: tl.constexpr, s, c, magic, BITS: tl.constexpr, dtype: tl.constexpr):
    """Value i of a 16-bit half word (its low bits, or the word >> 16), dequantized without a shift:
    masked in place and OR-ed into the mantissa of 2**23 it is exactly 2**23 + q * 2**(BITS * i),
    so (that - (2**23 + z * 2**(BITS * i))) * (s * 2**-(BITS * i)) is the exact (q - z) * s rounded
    once to fp32, as the dequantize kernel computes it. c, s: those per-column constants for i.
    magic is 0x4B000000 passed at run time: as a register it lets (half & mask) | magic be one LOP3
    (an instruction takes one immediate; with both constants ptxas emitted two)."""
    f = ((half & (((1 << BITS) - 1) << (i * BITS))) | magic).to(tl.float32, bitcast=True)
    return ((f - c) * s).to(dtype)


@triton.jit
def dequant_tile_t(words, s, z, magic, BITS: tl.constexpr, dtype: tl.constexpr):
    """Packed words [BLOCK_N, BLOCK_K // P] (uint32) -> the weight tile [BLOCK_N, BLOCK_K] in K order;
    s, z: fp32 [BLOCK_N, 1].

    Only elementwise ops on the words' own layout, then joins: each thread keeps its words' P values
    next to each other (K contiguous), so the tile reaches shared memory in 16-byte stores rather
    than one 16-bit store per value (what a broadcast over a [words, P, N] tensor compiled to).
    The join nesting puts value j at K offset ORDER[j] of the canonical layout: join(a, b) adds a
    last axis, so the outermost join picks the lowest bit of the K offset."""
    BN: tl.constexpr = words.shape[0]
    KW: tl.constexpr = words.shape[1]
    E: tl.constexpr = 1 << BITS  # 2**BITS: the step between value positions
    hi = words >> 16
    c0 = z + F32_MAGIC
    c1 = z * E + F32_MAGIC
    s1 = s * (1.0 / E)
    if BITS == 4:  # K offsets 0..7 hold values 0, 4, 1, 5, 2, 6, 3, 7; values 4..7 are hi's 0..3
        c2 = z * (E * E) + F32_MAGIC
        c3 = z * (E * E * E) + F32_MAGIC
        s2 = s * (1.0 / (E * E))
        s3 = s * (1.0 / (E * E * E))
        lo = tl.join(
            tl.join(value(words, 0, s, c0, magic, BITS, dtype), value(words, 2, s2, c2, magic, BITS, dtype)),
            tl.join(value(words, 1, s1, c1, magic, BITS, dtype), value(words, 3, s3, c3, magic, BITS, dtype)))
        up = tl.join(
            tl.join(value(hi, 0, s, c0, magic, BITS, dtype), value(hi, 2, s2, c2, magic, BITS, dtype)),
            tl.join(value(hi, 1, s1, c1, magic, BITS, dtype), value(hi, 3, s3, c3, magic, BITS, dtype)))
        return tl.reshape(tl.join(lo, up), (BN, KW * 8))
    else:  # natural order: values 0, 1 in the low half, 2, 3 in hi
        w = tl.join(tl.join(value(words, 0, s, c0, magic, BITS, dtype), value(hi, 0, s, c0, magic, BITS, dtype)),
                    tl.join(value(words, 1, s1, c1, magic, BITS, dtype), value(hi, 1, s1, c1, magic, BITS, dtype)))
        return tl.reshape(w, (BN, KW * 4))
