"""The torch definition of the routed experts' computation: the tests' reference and the CPU path.

For every token t and each of its k (expert e, weight g) pairs:

    out[t] = sum_k  g * (silu(x[t] @ w13[e, :I].T) * (x[t] @ w13[e, I:].T)) @ w2[e].T

w13 [E, 2I, H] holds each expert's gate rows and then its up rows; w2 [E, H, I] its down projection.
Rounding follows the Triton path: each GEMM accumulates in fp32, the activation (silu(gate) * up)
is rounded to x's dtype before the second GEMM, each pair's weighted output is rounded to x's dtype,
and the k pair outputs of a token are summed in fp32 and rounded once.

align_pairs_ref is the torch definition of the kernels' pair alignment (fused_moe.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def check_moe_args(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor) -> None:
    """The shapes every implementation needs; a ValueError naming the mismatch otherwise."""
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden], got shape {tuple(x.shape)}")
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 and w2 must be [experts, out, in], got {tuple(w13.shape)} and {tuple(w2.shape)}")
    E, two_i, H = w13.shape
    if two_i % 2 or w2.shape != (E, H, two_i // 2):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit [E, 2I, H] and [E, H, I]")
    if x.shape[1] != H:
        raise ValueError(f"x has hidden size {x.shape[1]}, the experts take {H}")
    if topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [tokens={x.shape[0]}, top_k]")
    if x.dtype != w13.dtype or x.dtype != w2.dtype:
        raise ValueError(f"x ({x.dtype}) and the expert weights ({w13.dtype}, {w2.dtype}) must share a dtype")


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k] (any float), topk_ids [T, k]
    (ids in [0, E)) -> [T, H] in x's dtype.

    One pass per expert that some token chose: the token-expert pairs are sorted by expert once, so
    each expert gathers its rows with one index and runs two matmuls; the only host sync is reading
    the per-expert counts."""
    check_moe_args(x, w13, w2, topk_weights, topk_ids)
    T, k = topk_ids.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    flat_ids = topk_ids.reshape(-1).long()
    if T and (flat_ids.min() < 0 or flat_ids.max() >= E):
        raise ValueError(f"expert ids must lie in [0, {E}), got {flat_ids.min().item()}..{flat_ids.max().item()}")
    order = torch.argsort(flat_ids, stable=True)       # pair ids (t * k + j), grouped by expert
    counts = torch.bincount(flat_ids, minlength=E).tolist()
    pair_out = torch.empty(T * k, x.shape[1], dtype=x.dtype, device=x.device)
    flat_w = topk_weights.reshape(-1).float()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        rows = x[pairs // k]
        h = _mm_fp32(rows, w13[e])
        act = (F.silu(h[:, :inter]) * h[:, inter:]).to(x.dtype)
        pair_out[pairs] = (_mm_fp32(act, w2[e]) * flat_w[pairs, None]).to(x.dtype)
    return pair_out.view(T, k, x.shape[1]).float().sum(dim=1).to(x.dtype)


def _mm_fp32(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a @ w.T with fp32 accumulation and an fp32 result (as the kernel's accumulator holds it)."""
    if a.dtype == torch.float32:
        return a @ w.t()
    return (a.float() @ w.float().t())


def align_pairs_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fused_moe.align_pairs_by_expert in torch ops (sort, scatter; about twenty launches where the
    Triton kernel makes one): (sorted_pairs int32 [max_padded], block_expert int32
    [max_padded / block_m], num_padded int32 [1])."""
    T, k = topk_ids.shape
    num_pairs = T * k
    dev = topk_ids.device
    worst = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    max_padded = -(-worst // block_m) * block_m
    flat = topk_ids.reshape(-1).long()
    # scatter_add, not bincount: bincount reads the max id back to the host on CUDA
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    dest = padded_start[expert_of] + torch.arange(num_pairs, device=dev) - start[expert_of]
    sorted_pairs = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=dev)
    sorted_pairs[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, max_padded, block_m, device=dev)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, block_expert.to(torch.int32), padded_end[-1:].to(torch.int32)
