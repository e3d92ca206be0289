"""W8A8 INT8 GEMM (Triton): per-token activation quantization, the GEMM, and a dispatcher.

    out[M, N] = (acc[M, N] * x_scale[m]) * w_scale[n] (+ bias),   acc = x_q[M, K] @ w_q[N, K].T (int32, exact)

x_q is int8 [M, K] row-major with fp32 scales [M, 1] (dynamic, per token) or one static scale [1];
w_q is int8 [N, K] with K contiguous, the layout checkpoints store and Int8LinearMethod keeps, with
fp32 scales [N] (per channel; per-tensor / per-shard scales are spread over the channels at load).
The kernels read the weight tile as [BLOCK_N, BLOCK_K] and hand tl.dot its transpose view: that is
the K-major B operand Hopper's int8 wgmma wants (8-bit MMAs take only K-major operands), so the
stored layout is used as is, with no re-layout at load and no copy per call.

Unlike torch._int_mm (cuBLASLt), which writes the int32 [M, N] accumulator to memory for separate
scale and cast kernels to read back, the scales, the bias and the cast to bf16/fp16 happen in the
GEMM's epilogue: the output is written once, in its final dtype.

Three GEMM kernels, one contract:
  _int8_gemm_kernel            pointer loads (cp.async pipelining), optional split-K in one launch for
                               few tokens (_split_k.py), any M, N, K (masked tails);
  _int8_gemm_tma_kernel        TMA descriptor loads (Hopper), zero-filled tails, no split-K; needs K % 16 == 0;
  int8_async_mma.py's kernel   Gluon, Hopper only: TMA loads and wgmma kept asynchronous, one K tile of
                               MMAs in flight (Triton's tl.dot waits for an int32 wgmma at every K step).
Tile configurations come from a small table keyed by M buckets (tiles.int8_gemm_tiles); a TileConfig
with tma=True selects the TMA kernel, tma=True and async_mma=True the Gluon one. tiles.INT8_TILES names the
candidate tiles for many tokens (benchmarks/int8_gemm.py --tiles times them on the 8B shapes).

int8_linear() is what Int8LinearMethod calls (through a custom op) on CUDA: one launch quantizes the
activations per token (or with the static scale), one launch runs the GEMM, for every token count.
The quantization matches ops.int8_quantize_per_token: s = absmax / 127.5 (float32 eps for an all-zero
row), q = clamp(round_half_even(x / s), -128, 127), with true divisions.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from splitserve.kernels.gemm._split_k import num_sms, split_k_buffers, split_k_epilogue
from splitserve.kernels.gemm.quant import INT8_HALF_RANGE, INT8_SCALE_EPS, quantize_per_token  # noqa: F401
from splitserve.kernels.gemm.tiles import INT8_CONFIG_TABLE, INT8_TILES, TileConfig, int8_gemm_tiles  # noqa: F401

SCALE_EPS = INT8_SCALE_EPS  # layers/quantization/ops._EPS: the scale of an all-zero row


def quantize_int8_per_token(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16/fp32) -> (q int8 [M, K], fp32 scales) with x ~= q * s, in one launch.

    Dynamic (scale None): one scale per token, [M, 1]. Static: the given one-element scale (a
    checkpoint's input_scale) for every row, returned as [1]. quant.quantize_per_token for INT8: the
    one per-token quantization of FP8 and INT8."""
    return quantize_per_token(x, torch.int8, scale)


# ---------------------------------------------------------------------------------------------
# GEMM
# ---------------------------------------------------------------------------------------------

@triton.jit
def _tile_coords(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped ordering: consecutive programs cover GROUP_M row tiles x every column tile in column
    # order, so a weight tile is read by GROUP_M programs close in time (from L2 after the first)
    # and the GROUP_M activation row tiles stay in L2 while the columns advance.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _scaled_epilogue(acc, offs_m, offs_n, M, N, a_scale_ptr, stride_as, w_scale_ptr, bias_ptr, out_ptr,
                     stride_om, part_ptr, count_ptr, tile_id, pid_k, num_splits,
                     HAS_BIAS: tl.constexpr, RAW_INT32: tl.constexpr, USE_SPLIT_K: tl.constexpr):
    offs_m = offs_m.to(tl.int64)  # row * stride_om passes 2^31 beyond ~75k tokens of a 28672-wide output
    if RAW_INT32:  # the exact accumulator, for tests and --check (never with split-K)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc, mask=mask)
    else:
        sa = tl.load(a_scale_ptr + offs_m * stride_as, mask=offs_m < M, other=0.0)
        sw = tl.load(w_scale_ptr + offs_n, mask=offs_n < N, other=0.0)
        # the same order as the torch path: (acc * x_scale) * w_scale, then the bias, then one rounding
        accf = acc.to(tl.float32) * sa[:, None] * sw[None, :]
        split_k_epilogue(accf, offs_m, offs_n, M, N, out_ptr, stride_om, part_ptr, count_ptr, bias_ptr,
                         tile_id, pid_k, num_splits, HAS_BIAS, USE_SPLIT_K)


@triton.jit
def _int8_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, k_per_split, num_splits, stride_am, stride_wn, stride_om, stride_as,
    HAS_BIAS: tl.constexpr, RAW_INT32: tl.constexpr, EVEN_K: tl.constexpr, USE_SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = _tile_coords(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past M / N read a valid row again (no mask on the hot loads); the epilogue masks them.
    rows_a = (offs_m % M).to(tl.int64)
    rows_w = (offs_n % N).to(tl.int64)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :]
        w_ptrs = w_ptr + rows_w[:, None] * stride_wn + offs_k[None, :]
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_end, other=0)
            w = tl.load(w_ptrs, mask=offs_k[None, :] < k_end, other=0)
        acc = tl.dot(a, tl.trans(w), acc, out_dtype=tl.int32)
    _scaled_epilogue(acc, offs_m, offs_n, M, N, a_scale_ptr, stride_as, w_scale_ptr, bias_ptr, out_ptr,
                     stride_om, part_ptr, count_ptr, pid, pid_k, num_splits, HAS_BIAS, RAW_INT32, USE_SPLIT_K)


@triton.jit
def _int8_gemm_tma_kernel(
    a_desc, a_scale_ptr, w_desc, w_scale_ptr, bias_ptr, out_ptr,
    M, N, K, stride_om, stride_as,
    HAS_BIAS: tl.constexpr, RAW_INT32: tl.constexpr, WARP_SPEC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # The descriptors' boxes are [BLOCK_M, BLOCK_K] and [BLOCK_N, BLOCK_K]; TMA fills the parts
    # past M, N, K with zeros, so the loop has no masks and the partial last K tile adds nothing.
    pid = tl.program_id(0)
    pid_m, pid_n = _tile_coords(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in tl.range(0, K, BLOCK_K, warp_specialize=WARP_SPEC):
        a = a_desc.load([off_m, k0])
        w = w_desc.load([off_n, k0])
        acc = tl.dot(a, w.T, acc, out_dtype=tl.int32)
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    _scaled_epilogue(acc, offs_m, offs_n, M, N, a_scale_ptr, stride_as, w_scale_ptr, bias_ptr, out_ptr,
                     stride_om, out_ptr, out_ptr, pid, 0, 1, HAS_BIAS, RAW_INT32, False)


# Above this many tokens the table's tile is loaded by TMA where the tensors allow it (K % 16 == 0,
# aligned, sm90): 1000 x 1024/128 on the 8B shape went from 37,234 to 39,766 tok/s on one H100.
INT8_TMA_MIN_M = 256


def hopper_wgmma(device: torch.device) -> bool:
    """Whether the async-MMA kernel (int8_async_mma.py) can run: its warpgroup MMA exists on compute
    capability 9.x only (not on Blackwell), and it needs Triton's experimental Gluon API."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9 and _gluon_available()


@functools.cache
def _gluon_available() -> bool:
    try:
        import splitserve.kernels.gemm.int8.int8_async_mma  # noqa: F401
    except ImportError:
        return False
    return True


def tma_supported(x_q: torch.Tensor, w: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned bases and row strides, and compute capability 9.0+ on a GPU."""
    K = x_q.shape[1]
    ok = K % 16 == 0 and x_q.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0 \
        and x_q.stride(0) % 16 == 0 and w.stride(0) % 16 == 0
    if x_q.device.type == "cuda":
        ok = ok and torch.cuda.get_device_capability(x_q.device) >= (9, 0)
    return ok


def int8_gemm(x_q: torch.Tensor, x_scale: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor | None,
              bias: torch.Tensor | None = None, *, out_dtype: torch.dtype = torch.bfloat16,
              config: TileConfig | None = None) -> torch.Tensor:
    """The Triton W8A8 INT8 GEMM (module docstring). x_q int8 [M, K], x_scale fp32 [M, 1] / [M] or one
    element; w int8 [N, K], w_scale fp32 [N] / [N, 1] or one element; bias [N] or None.

    out_dtype torch.int32 returns the raw accumulator x_q @ w.T (scales and bias must then be None)."""
    _check_2d("x_q", x_q)
    _check_2d("w", w)
    if x_q.dtype != torch.int8 or w.dtype != torch.int8:
        raise ValueError(f"x_q and w must be int8, got {x_q.dtype} and {w.dtype}")
    M, K = x_q.shape
    N = w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"x_q is [{M}, {K}] but w is {list(w.shape)}: K differs")
    raw = out_dtype == torch.int32
    if raw:
        if x_scale is not None or w_scale is not None or bias is not None:
            raise ValueError("the raw int32 accumulator takes no scales and no bias")
    else:
        if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"out_dtype must be bfloat16, float16, float32 or int32, got {out_dtype}")
        if x_scale is None or w_scale is None:
            raise ValueError("scaled output needs x_scale and w_scale")
        if x_scale.numel() not in (1, M):
            raise ValueError(f"x_scale of shape {tuple(x_scale.shape)} is neither per token ([{M}, 1]) nor one scale")
        if w_scale.numel() not in (1, N):
            raise ValueError(f"w_scale of shape {tuple(w_scale.shape)} is neither per channel ([{N}]) nor one scale")
        if bias is not None and tuple(bias.shape) != (N,):
            raise ValueError(f"bias must have shape [{N}], got {tuple(bias.shape)}")
    out = torch.empty((M, N), dtype=out_dtype, device=x_q.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(M, N))
    x_q = x_q if x_q.stride(1) == 1 else x_q.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    cfg = config or int8_gemm_tiles(M, N, K, num_sms(x_q.device))
    if config is None:
        # the table's tile on TMA above INT8_TMA_MIN_M tokens (or when it names the async kernel)
        # where the tensors allow it; the pointer kernel with the same tile where they do not
        use_tma = (M > INT8_TMA_MIN_M or cfg.async_mma) and not raw and tma_supported(x_q, w)
        cfg = dataclasses.replace(cfg, tma=use_tma, warp_spec=cfg.warp_spec and use_tma,
                                  async_mma=cfg.async_mma and use_tma and hopper_wgmma(x_q.device))
    if raw:
        x_s = w_s = out
        stride_as = 0
    else:
        # fp32 and contiguous already on the layer's path: these are no-ops, not copies
        x_s = x_scale.reshape(-1).to(torch.float32).contiguous()
        stride_as = 0 if x_s.numel() == 1 else 1
        w_s = w_scale.reshape(-1).to(torch.float32).expand(N).contiguous()
    bias_arg = bias if bias is not None else out
    num_tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    if (cfg.warp_spec or cfg.async_mma) and not cfg.tma:
        raise ValueError("warp specialization and the async-MMA kernel are TMA-kernel options (tma=True)")
    if cfg.tma:
        if cfg.split_k > 1:
            raise ValueError("the TMA kernel has no split-K")
        if not tma_supported(x_q, w):
            raise ValueError("the TMA kernel needs K % 16 == 0, 16-byte aligned tensors and sm90+")
        if cfg.async_mma:
            from splitserve.kernels.gemm.int8.int8_async_mma import launch_async_mma  # Gluon: only where used
            launch_async_mma(x_q, x_s, w, w_s, bias_arg, out, stride_as, cfg, num_tiles,
                             has_bias=bias is not None, raw=raw)
            return out
        from triton.tools.tensor_descriptor import TensorDescriptor
        a_desc = TensorDescriptor.from_tensor(x_q, [cfg.block_m, cfg.block_k])
        w_desc = TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k])
        _int8_gemm_tma_kernel[(num_tiles,)](
            a_desc, x_s, w_desc, w_s, bias_arg, out, M, N, K, out.stride(0), stride_as,
            HAS_BIAS=bias is not None, RAW_INT32=raw, WARP_SPEC=cfg.warp_spec,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return out
    k_per_split, num_splits, part, counters = split_k_buffers(K, cfg.split_k, cfg.block_k, num_tiles, out)
    use_split = num_splits > 1
    if use_split and raw:
        raise ValueError("the raw int32 accumulator is written without split-K (split_k=1)")
    _int8_gemm_kernel[(num_tiles, num_splits)](
        x_q, x_s, w, w_s, bias_arg, out, part, counters,
        M, N, K, k_per_split, num_splits, x_q.stride(0), w.stride(0), out.stride(0), stride_as,
        HAS_BIAS=bias is not None, RAW_INT32=raw,
        EVEN_K=K % cfg.block_k == 0 and k_per_split % cfg.block_k == 0, USE_SPLIT_K=use_split,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


# ---------------------------------------------------------------------------------------------
# dispatcher
# ---------------------------------------------------------------------------------------------

def int8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                *, input_scale: torch.Tensor | None = None, config: TileConfig | None = None) -> torch.Tensor:
    """y = dequant(quant(x)) @ dequant(w).T + bias for x [..., K] (bf16/fp16/fp32), w int8 [N, K],
    w_scale fp32 [N] (or one), in x's dtype: quantize_int8_per_token (dynamic, or the static
    `input_scale`) then int8_gemm, two launches for every token count. Triton kernels: a CUDA
    device, or TRITON_INTERPRET=1 on CPU (the tests)."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"int8_linear takes bf16/fp16/fp32 activations, got {x.dtype}")
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    q, s = quantize_int8_per_token(x2, input_scale)
    out = int8_gemm(q, s, w, w_scale, bias, out_dtype=x.dtype, config=config)
    return out.reshape(*lead, w.shape[0])


def _check_2d(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
