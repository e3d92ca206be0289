"""Rotary position embedding over the flat token stream (each token carries its own position)."""
from __future__ import annotations

import math

import torch
from torch import nn


def rope_parameters(hf_config) -> dict:
    """The config's RoPE settings as one dict, from either transformers 5 (`rope_parameters`) or 4
    (`rope_theta` + `rope_scaling`)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high = p["factor"], p.get("low_freq_factor", 1.0), p.get("high_freq_factor", 4.0)
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """The model's rotary table; it holds no forward: the attention op applies it."""
    SUPPORTED = ("default", "linear", "llama3")

    def __init__(self, head_dim: int, max_position: int, params: dict):
        super().__init__()
        rope_type = params["rope_type"]
        if rope_type not in self.SUPPORTED:
            raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(self.SUPPORTED)})")
        base = params["rope_theta"]
        rot_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        # fp32 like transformers, so both compute the same angles
        inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
        if rope_type == "linear":
            inv_freq = inv_freq / params["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.rot_dim = rot_dim
        # [max_position, rot_dim]: cos | sin halves, fp32. The attention op rotates q and k with it
        # (fused into its KV store on the Triton backend); see apply_rotary.
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1).float(), persistent=False)


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated at positions [T], NeoX (half-split) style, over the first rot_dim of each
    head (cos_sin [max_position, rot_dim]: cos | sin halves, fp32); computed in fp32, returned in
    x's dtype. The reference for the attention backends, which apply it to q and k."""
    rot_dim = cos_sin.shape[-1]
    cos, sin = cos_sin[positions].chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot, rest = x[..., :rot_dim].float(), x[..., rot_dim:]
    x1, x2 = rot.chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


def apply_rotary_qk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                    cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary(q, ...), apply_rotary(k, ...) (the same values: the same element-wise maths) in
    one pass over [T, Hq + Hkv, D]: one table lookup and one set of element-wise ops instead of two.
    Returns views of one tensor."""
    qk = apply_rotary(torch.cat([q, k], dim=1), positions, cos_sin)
    return qk.split([q.shape[1], k.shape[1]], dim=1)
