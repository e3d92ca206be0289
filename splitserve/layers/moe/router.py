"""Top-k routing: router logits [T, E] -> (weights fp32 [T, k], expert ids int32 [T, k]).

Mixtral and Qwen2-MoE both take the softmax over all experts in fp32 and keep the k largest
probabilities. Mixtral always renormalises the k kept weights to sum to one; Qwen2-MoE does so only
when the config's `norm_topk_prob` is set (the Qwen1.5-MoE checkpoints leave it off, so their weights
are the raw softmax probabilities). The weights stay fp32 here; transformers' Qwen2-MoE rounds them
to the activations' dtype first (no difference in fp32, under half a bf16 ulp of each weight in bf16).
"""
from __future__ import annotations

import torch


def topk_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts (fp32), the top_k largest, optionally renormalised to sum to one.

    Returns (topk_weights fp32 [T, top_k], topk_ids int32 [T, top_k]). Ties go to the lower expert
    id, as torch.topk (and so transformers) breaks them."""
    if router_logits.dim() != 2:
        raise ValueError(f"router logits must be [tokens, experts], got shape {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be between 1 and the number of experts ({num_experts}), got {top_k}")
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)
