"""One tile-config type for every quantized GEMM / GEMV kernel, and each kernel's default tiles.

`TileConfig` holds what every variant has (the block sizes, split-K, warps, pipeline stages, the
grouped tile order) and, as named fields with neutral defaults, the few extras one variant reads:

    variant       kernel module                 extras it reads
    fp8_gemm      fp8/fp8_gemm.py               -
    fp8_gemv      fp8/fp8_gemv.py               prefetch (block_m unused: one program takes every row)
    int8_gemm     int8/int8_gemm.py (+ Gluon)   group_m, tma, warp_spec, async_mma
    wna16_gemm    wna16/wna16_gemm.py           unpack_bcast
    wna16_gemv    wna16/wna16_gemv.py           prefetch (block_m unused)
    wna16_tiled   wna16/wna16_tiled.py          swap_ab (split_k unused)
    wna16_wgmma   wna16/wna16_wgmma.py (Gluon)  split_k 0 (auto) with programs_per_sm

`DEFAULT_TILES[variant](M, N, K, ...)` (or the function it names) picks a variant's tiles for a shape;
the rules and their measurements are each function's docstring. The choices are pinned shape by
shape in tests/layers/test_gemm_tiles.py. This module imports no kernel (the kernel modules import
it), and nothing of Gluon.
"""
from __future__ import annotations

from dataclasses import dataclass

from splitserve.kernels.gemm._split_k import gemv_split_for, split_k_for
from splitserve.kernels.gemm.wna16.wna16_layout import largest_pow2_divisor


@dataclass(frozen=True, kw_only=True)
class TileConfig:
    block_m: int = 0          # tokens per tile; 0 for the GEMVs (one program holds every row of x)
    block_n: int              # output features per tile
    block_k: int              # reduction step
    split_k: int = 1          # K slices reduced in the split-K epilogue (_split_k.py); wna16_wgmma: 0 = auto
    num_warps: int = 4
    num_stages: int = 4       # software-pipeline stages (the Gluon kernels: their smem ring depth)
    group_m: int = 8          # int8_gemm: M tiles of one grouped (L2-friendly) tile order
    tma: bool = False         # int8_gemm: tiles loaded by TMA
    warp_spec: bool = False   # int8_gemm TMA kernel: Triton's warp specialization (loader and MMA warps)
    async_mma: bool = False   # int8_gemm: the Gluon kernel, one K tile's MMAs left in flight (needs tma)
    prefetch: bool = False    # the GEMVs: load the next K step's tile before this step's arithmetic
    unpack_bcast: bool = False  # wna16_gemm: unpack the words by a broadcast over [words, P, N]
    swap_ab: bool = False     # wna16_tiled: W tile as the MMA's A operand (few tokens)
    programs_per_sm: float = 1.0  # wna16_wgmma with split_k 0: enough K slices for this many programs an SM

    def describe(self) -> str:
        s = f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages} g{self.group_m}"
        return (s + (f" split{self.split_k}" if self.split_k > 1 else "") + (" tma" if self.tma else "")
                + (" ws" if self.warp_spec else "") + (" async" if self.async_mma else "")
                + (" prefetch" if self.prefetch else "") + (" bcast" if self.unpack_bcast else "")
                + (" swap" if self.swap_ab else ""))

    @property
    def name(self) -> str:
        """The key of INT8_TILES: kernel_BMxBNxBK_wWARPSsSTAGES (+ _gGROUP when not 8)."""
        kind = "async" if self.async_mma else "tmaws" if self.warp_spec else "tma" if self.tma else "ptr"
        return (f"{kind}_{self.block_m}x{self.block_n}x{self.block_k}_w{self.num_warps}s{self.num_stages}"
                + (f"_g{self.group_m}" if self.group_m != 8 else "")
                + (f"_split{self.split_k}" if self.split_k > 1 else ""))


# -- FP8 ---------------------------------------------------------------------------------------------
def fp8_gemm_tiles(M: int, N: int, K: int, a_mode: int, grouped: bool, num_sms: int = 132) -> TileConfig:
    """Tile choice for the shapes this engine runs, from the H100 sweep of the 8B shapes
    (BENCHMARKS.md). grouped: scales vary along K in groups of 128 (activation groups or weight
    blocks), so block_k must divide 128."""
    if M > 64:
        return TileConfig(block_m=128, block_n=128, block_k=128, split_k=1, num_warps=8, num_stages=3)
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    if a_mode == 2:
        # the in-kernel quantization of each [block_m, 128] x tile is shared by block_n weight rows
        block_n, block_k, stages = (128 if M <= 4 or block_m == 64 else 64), 128, 3
    elif block_m == 16:
        block_n, block_k, stages = (64 if M <= 4 else 32), 256, (3 if M <= 4 else 5)
    else:
        block_n, block_k, stages = 32, 128, 4
    if grouped:
        block_k = min(block_k, 128)
    return TileConfig(block_m=block_m, block_n=block_n, block_k=block_k,
                      split_k=split_k_for(M, N, K, block_m, block_n, block_k, num_sms), num_warps=4, num_stages=stages)


def fp8_gemv_tiles(M: int, N: int, K: int, num_sms: int = 132) -> TileConfig:
    """The H100 sweep's best single tiles (benchmarks/fp8_gemv.py, BENCHMARKS.md sixteenth session;
    8B layers 2.75 ms at one token against 3.44 for the tl.dot kernel, 2.98 against 3.34 at two):
    one token, 8 rows x 1024 K per step; two tokens, 16 x 512 (each row of x holds its own FFMA
    chains); 4 warps, split-K for 4 / 2 programs per SM. No prefetch: carrying the fp8 tile across
    iterations costs ~2 byte shuffles per byte (PRMT/LOP3 in the sm_90 SASS), and several resident
    programs keep loads in flight anyway (the prefetch variant measured slowest)."""
    block_n, block_k, per_sm = (8, 1024, 4.0) if M <= 1 else (16, 512, 2.0)
    return TileConfig(block_n=block_n, block_k=block_k, split_k=gemv_split_for(N, K, block_n, block_k, num_sms, per_sm),
                      num_warps=4, num_stages=1)


# -- INT8 --------------------------------------------------------------------------------------------
def _int8_tile(bm: int, bn: int, bk: int, warps: int, stages: int, kind: str) -> TileConfig:
    return TileConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, tma=kind != "ptr",
                      warp_spec=kind == "tmaws", async_mma=kind == "async")


# Named tiles for 256+ tokens, the candidates of benchmarks/int8_gemm.py --tiles (each compiled for
# sm_90a without spills, within 227 KiB of shared memory: --compile-only). INT8_CONFIG_TABLE below
# can take any of them by name, e.g. INT8_TILES["async_128x256x128_w8s4"].
#   tma_*    the Triton TMA kernel (its int32 wgmma waited at every K tile): the two current
#            defaults, and 128x128 tiles of 4 warps in 96 KiB, two CTAs an SM, so that one CTA's
#            MMAs run while the other's drain
#   tmaws_*  the same kernel with Triton's warp specialization (a TMA loader warp)
#   async_*  the Gluon kernel (int8/int8_async_mma.py): one K tile of MMAs always queued;
#            the w4s3 128x128 and the 64x128 tiles (96 KiB, <= 199 registers) also run two CTAs an SM
INT8_TILES: dict[str, TileConfig] = {c.name: c for c in [
    _int8_tile(128, 256, 128, 8, 3, "tma"),
    _int8_tile(128, 128, 128, 8, 4, "tma"),
    _int8_tile(128, 128, 128, 4, 3, "tma"),
    _int8_tile(128, 128, 128, 4, 4, "tmaws"),
    _int8_tile(128, 256, 128, 8, 3, "async"),
    _int8_tile(128, 256, 128, 8, 4, "async"),
    _int8_tile(256, 128, 128, 8, 4, "async"),
    _int8_tile(128, 128, 128, 4, 4, "async"),
    _int8_tile(128, 128, 128, 4, 3, "async"),
    _int8_tile(64, 128, 128, 4, 4, "async"),
]}

# (largest M, config) in increasing M; None = the few-token rule in int8_gemm_tiles. Hopper guesses
# to be confirmed by benchmarks/int8_gemm.py --sweep: 128-row tiles with 128-byte K tiles (one
# 128B-swizzled smem row per tile row), 8 warps for the 128x256 int32 accumulator (128 registers a
# thread), 3 stages of 48 KiB.
# Above 256 tokens the Gluon kernel (async MMAs), from the H100 tile sweep (BENCHMARKS.md, sixteenth
# session: `int8_gemm.py --tiles`): bf16's time over INT8's for the 8B layer's four matmuls
# was 1.49 at 512 tokens with 128x128 tiles of 4 warps (1.26 with the TMA tile before), 1.82-1.85 at
# 2048-8192 with 128x256 tiles of 8 warps (1.30-1.44 before). Off Hopper those tiles run on the TMA
# or pointer kernel (int8_gemm).
INT8_CONFIG_TABLE: list[tuple[int, TileConfig | None]] = [
    (64, None),
    (256, TileConfig(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=4)),
    (1024, INT8_TILES["async_128x128x128_w4s4"]),
    (1 << 62, INT8_TILES["async_128x256x128_w8s4"]),
]


def int8_gemm_tiles(M: int, N: int, K: int, n_sms: int = 132) -> TileConfig:
    """The table's tile for M tokens; up to 256 tokens K is split while the output tiles are too few
    for the SMs (decode reads every weight once: the SMs must all stream)."""
    for max_m, cfg in INT8_CONFIG_TABLE:
        if M <= max_m:
            break
    if cfg is None:
        # few tokens: the FP8 kernel's H100 choices (same bytes per weight, same MMA K of 32)
        block_m = 16 if M <= 16 else 32 if M <= 32 else 64
        block_n, block_k, stages = (64, 256, 3) if M <= 4 else (32, 256, 5) if block_m == 16 else (32, 128, 4)
        cfg = TileConfig(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=4, num_stages=stages)
    if M <= 256 and not cfg.async_mma:
        cfg = TileConfig(**{**cfg.__dict__, "split_k": split_k_for(M, N, K, cfg.block_m, cfg.block_n,
                                                                   cfg.block_k, n_sms)})
    return cfg


# -- weight-only int4 / int8 -------------------------------------------------------------------------
# Up to this many tokens wna16_gemm splits K (few output tiles); above, one program per output tile.
WNA16_SPLIT_K_MAX_M = 64


def wna16_gemm_tiles(M: int, N: int, K: int, group_size: int, num_sms: int = 132) -> TileConfig:
    """Tile choice (H100 sweep of the 8B shapes, BENCHMARKS.md). block_k divides the group size."""
    block_k = largest_pow2_divisor(group_size, 128)
    if M <= 16:
        return TileConfig(block_m=16, block_n=64, block_k=block_k,
                          split_k=split_k_for(M, N, K, 16, 64, block_k, num_sms, 2.9), num_warps=4, num_stages=5)
    if M <= WNA16_SPLIT_K_MAX_M:
        block_m = 32 if M <= 32 else 64
        return TileConfig(block_m=block_m, block_n=128, block_k=block_k,
                          split_k=split_k_for(M, N, K, block_m, 128, block_k, num_sms), num_warps=4, num_stages=3)
    block_m = 64 if M <= 128 else 128
    return TileConfig(block_m=block_m, block_n=128, block_k=largest_pow2_divisor(group_size, 64), split_k=1,
                      num_warps=8 if block_m == 128 else 4, num_stages=3)


def gemv_block_k(group_size: int, bits: int, cap: int) -> int:
    """Largest power of two <= cap dividing the group size, at least one word of values."""
    return largest_pow2_divisor(group_size, cap, floor=32 // bits)


def _swept_int4_gemv_tiles(M: int, N: int, K: int, group_size: int) -> TileConfig | None:
    """The H100 sweep's best tiles for int4 at 1-2 tokens on the 8B shapes (BENCHMARKS.md, fourteenth
    session), as rules by shape: wide layers (gate_up, N >= 16384), deep ones (down, K >= 8192), the
    rest (qkv, o). Splits are capped at the K tiles there are."""
    if M == 1:
        block_n, block_k, split, warps, prefetch = ((256, 128, 16, 1, False) if N >= 16384 else
                                                    (256, 64, 32, 2, True) if K >= 8192 else
                                                    (256, 128, 16, 4, False))
    elif M == 2:
        block_n, block_k, split, warps, prefetch = ((512, 32, 16, 4, True) if N >= 16384 else
                                                    (512, 32, 32, 4, True) if N >= 6144 and K < 8192 else
                                                    (256, 32, 32, 2, True))
    else:
        return None
    block_k = gemv_block_k(group_size, 4, block_k)
    return TileConfig(block_n=block_n, block_k=block_k, split_k=max(1, min(split, -(-K // block_k))),
                      num_warps=warps, num_stages=1, prefetch=prefetch)


def wna16_gemv_tiles(M: int, N: int, K: int, bits: int, group_size: int, has_zero: bool = False,
                     num_sms: int = 132) -> TileConfig:
    """int4 without zero points at 1-2 tokens: the H100 sweep's tiles (_swept_int4_gemv_tiles; at one
    token they took the 8B layers from 3.07 ms with the rules below to 2.12 ms). Otherwise the tile
    choice before that sweep, from the sm_90 SASS of the 8B shapes (main loop):
    - 8 columns per thread (BLOCK_N = 256 * num_warps): ~25 instructions per int4 word at one token
      against ~30 with 4 (x's loads and offsets are shared by a thread's columns); 4 at 5-8 tokens.
    - word rows per tile 8 at 1-2 tokens, 4 up to 4 tokens (2 with zero points), 2 above: each
      row of x holds its own FFMA chains in registers, and bigger tiles spill.
    - 2 warps for wide layers, 1 for narrow ones (N 4096: more N tiles, fewer split-K partials);
      split-K for ~3 programs per SM."""
    swept = _swept_int4_gemv_tiles(M, N, K, group_size) if bits == 4 and not has_zero else None
    if swept is not None:
        return swept
    word_rows = 8 if M <= 2 else (2 if has_zero else 4) if M <= 4 else 2
    block_k = gemv_block_k(group_size, bits, word_rows * (32 // bits))
    num_warps = 2 if N >= 16384 else 1
    block_n = (256 if M <= 4 else 128) * num_warps
    return TileConfig(block_n=block_n, block_k=block_k, split_k=gemv_split_for(N, K, block_n, block_k, num_sms, 3.0),
                      num_warps=num_warps, num_stages=1)


def wna16_tiled_tiles(M: int, N: int, K: int, group_size: int) -> TileConfig:
    """Tiles for the interpreter tests and the sweep's default. Not tuned: on the H100 sweep
    (benchmarks/wna16_tiled.py) no tile of this kernel beat dequantize + cuBLAS, so no route runs it."""
    block_k = 64 if group_size % 64 == 0 else group_size
    if M <= 64:
        return TileConfig(block_m=64, block_n=128, block_k=block_k, num_warps=4, num_stages=3, swap_ab=True)
    return TileConfig(block_m=128, block_n=128, block_k=block_k, num_warps=4, num_stages=3)


def wna16_wgmma_tiles(M: int, N: int, K: int, group_size: int) -> TileConfig:
    """The H100 sweep's tiles (benchmarks/wna16_tiled.py, BENCHMARKS.md sixteenth session) for the
    8B shapes at 128-256 tokens: 128x64 tiles of 4 warps, K split for two programs an SM, except the
    wide gate_up (N >= 16384), which has output tiles enough: 128x128 (128 tokens) or 256x128 of 8 warps.
    num_stages is the cp.async ring depth (>= 3: stages - 2 tiles prefetched)."""
    block_k = 64 if group_size % 64 == 0 else 32
    if N >= 16384:
        return TileConfig(block_m=128 if M <= 128 else 256, block_n=128, block_k=block_k, num_warps=8, num_stages=4,
                          split_k=0, programs_per_sm=1.0)
    return TileConfig(block_m=128, block_n=64, block_k=block_k, num_warps=4, num_stages=4, split_k=0,
                      programs_per_sm=2.0)


# The one way to pick a variant's default tiles: DEFAULT_TILES[variant](M, N, K, <its shape arguments>).
DEFAULT_TILES = {
    "fp8_gemm": fp8_gemm_tiles,        # (M, N, K, a_mode, grouped, num_sms)
    "fp8_gemv": fp8_gemv_tiles,        # (M, N, K, num_sms)
    "int8_gemm": int8_gemm_tiles,      # (M, N, K, n_sms)
    "wna16_gemm": wna16_gemm_tiles,    # (M, N, K, group_size, num_sms)
    "wna16_gemv": wna16_gemv_tiles,    # (M, N, K, bits, group_size, has_zero, num_sms)
    "wna16_tiled": wna16_tiled_tiles,  # (M, N, K, group_size)
    "wna16_wgmma": wna16_wgmma_tiles,  # (M, N, K, group_size)
}
