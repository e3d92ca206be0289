"""Quantization arithmetic shared by the FP8 and INT8 methods, in plain torch (compile-friendly:
no Python branch on tensor values).

The definitions follow compressed-tensors, the library that writes these checkpoints (and so the
reference the tests compare with): a symmetric scale is absmax / (range / 2), i.e. absmax / 448 for
FP8 E4M3 and absmax / 127.5 for INT8; values are divided by the scale, rounded (to nearest even)
and clamped; a zero absmax gets the float32 epsilon as its scale.
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
INT8_MIN, INT8_MAX = -128.0, 127.0
INT8_HALF_RANGE = 127.5
_EPS = float(torch.finfo(torch.float32).eps)


def _scale_from_absmax(absmax: torch.Tensor, half_range: float) -> torch.Tensor:
    scale = absmax.float() / half_range
    return torch.where(scale == 0, torch.full_like(scale, _EPS), scale)


# -- FP8 --------------------------------------------------------------------------------------------
def fp8_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to FP8 E4M3 (scale broadcasts against x)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def fp8_quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (FP8 [M, K], fp32 scales [M, 1]): one dynamic scale per token."""
    scale = _scale_from_absmax(x.abs().amax(dim=-1, keepdim=True), FP8_MAX)
    return fp8_quantize(x, scale), scale


def fp8_quantize_per_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (FP8 [M, K], fp32 scales [M, K / group]): a dynamic scale per token and per group
    of `group` input features (the activations of block-wise FP8)."""
    m, k = x.shape
    g = x.reshape(m, k // group, group)
    scale = _scale_from_absmax(g.abs().amax(dim=-1, keepdim=True), FP8_MAX)
    return fp8_quantize(g, scale).reshape(m, k), scale.reshape(m, k // group)


def fp8_quantize_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (FP8 [N, K], fp32 scales [N]): online quantization, one scale per output row."""
    scale = _scale_from_absmax(w.abs().amax(dim=1, keepdim=True), FP8_MAX)
    return fp8_quantize(w, scale), scale.reshape(-1)


def fp8_quantize_weight_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (FP8 [N, K], fp32 scales [ceil(N/bn), ceil(K/bk)]) with one scale per block."""
    bn, bk = block
    n, k = w.shape
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    blocks = padded.reshape(rows, bn, cols, bk)
    scale = _scale_from_absmax(blocks.abs().amax(dim=(1, 3)), FP8_MAX)
    q = fp8_quantize(blocks, scale[:, None, :, None]).reshape(rows * bn, cols * bk)[:n, :k]
    return q.contiguous(), scale


def expand_block_scale(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """[ceil(N/bn), ceil(K/bk)] block scales -> one per weight element, [N, K]."""
    bn, bk = block
    return scale.repeat_interleave(bn, dim=0)[:shape[0]].repeat_interleave(bk, dim=1)[:, :shape[1]]


def dequantize_per_group(xq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[M, K] quantized with scales [M, K / g] (one per token and group of g) -> float32 [M, K]."""
    m, k = xq.shape
    groups = scale.shape[1]
    return (xq.float().reshape(m, groups, k // groups) * scale.unsqueeze(-1)).reshape(m, k)


# -- INT8 -------------------------------------------------------------------------------------------
def int8_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.round(x.float() / scale).clamp(INT8_MIN, INT8_MAX).to(torch.int8)


def int8_quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (int8 [M, K], fp32 scales [M, 1]): symmetric, one dynamic scale per token."""
    scale = _scale_from_absmax(x.abs().amax(dim=-1, keepdim=True), INT8_HALF_RANGE)
    return int8_quantize(x, scale), scale


def int8_quantize_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], fp32 scales [N])."""
    scale = _scale_from_absmax(w.abs().amax(dim=1, keepdim=True), INT8_HALF_RANGE)
    return int8_quantize(w, scale), scale.reshape(-1)


# -- merged per-tensor scales -----------------------------------------------------------------------
def per_shard_to_per_channel(scales: torch.Tensor, shard_offsets: dict[str, tuple[int, int]],
                             out_features: int) -> torch.Tensor:
    """One scale per merged shard ([num_shards]) -> one per output feature ([N]). Exact: each shard
    keeps the scale its weights were quantized with (no requantization to a common maximum)."""
    if not shard_offsets:
        return scales.float().reshape(1).expand(out_features).contiguous()
    sizes = torch.tensor([size for _, size in shard_offsets.values()], device=scales.device)
    return scales.float().repeat_interleave(sizes)


# -- capability checks for the GPU paths -----------------------------------------------------------
def has_fp8_matmul(device: torch.device) -> bool:
    """torch._scaled_mm with FP8 inputs needs compute capability 8.9 (Ada) or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
