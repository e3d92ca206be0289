"""Rotary position embedding over the flat token stream (each token carries its own position).

The model builds one table, cos | sin per position (fp32), and the attention op rotates q and k with
it. Every scaling type is a different table; none needs anything at run time:

- default, linear (positions divided by `factor`), llama3 (Llama 3.1's per-frequency smoothing);
- dynamic (NTK): transformers changes the base only for sequences longer than
  max_position_embeddings, which the engine never runs (max_model_len is capped there), so its
  table is the default one;
- yarn: blended interpolated / extrapolated frequencies, cos and sin scaled by the attention factor;
- longrope (Phi-3): `long_factor` frequencies when the engine serves contexts longer than
  original_max_position_embeddings (max_model_len, `fit_context`), else `short_factor` ones, cos and
  sin scaled by the attention factor. One set for every position, as vLLM and llama.cpp choose it:
  keys already cached cannot change their rotation. transformers uses the short set while a
  sequence fits and recomputes its cache with the long one once it grows past; so the two agree
  on every sequence when max_model_len <= original_max_position_embeddings, and on every sequence
  longer than that otherwise.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def rope_parameters(hf_config) -> dict:
    """The config's RoPE settings as one dict, from either transformers 5 (`rope_parameters`) or 4
    (`rope_theta` + `rope_scaling`), with the fields some scaling types read from the config's top
    level (partial_rotary_factor, original_max_position_embeddings) filled in."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    for key in ("partial_rotary_factor", "original_max_position_embeddings"):
        if params.get(key) is None and getattr(hf_config, key, None) is not None:
            params[key] = getattr(hf_config, key)
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


def _yarn(rot_dim: int, base: float, p: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN's frequencies and attention factor (the YaRN paper's recipe, as transformers computes it)."""
    old_len = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_position / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    fast, slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over old_len
        return rot_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate (divide by factor)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention)


def _longrope_factor(p: dict, max_position: int) -> float:
    old_len = p["original_max_position_embeddings"]
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    factor = p.get("factor") or max_position / old_len
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))


class RotaryEmbedding(nn.Module):
    """The model's rotary table; it holds no forward: the attention op applies it.

    max_position: the table's rows (the model's max_position_embeddings, which also sets the
    default factor of yarn and longrope)."""
    SUPPORTED = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")

    def __init__(self, head_dim: int, max_position: int, params: dict):
        super().__init__()
        rope_type = params["rope_type"]
        if rope_type not in self.SUPPORTED:
            raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(self.SUPPORTED)})")
        base = params["rope_theta"]
        rot_dim = int(head_dim * (params.get("partial_rotary_factor") or 1.0))
        # fp32 like transformers, so both compute the same angles
        exponents = torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim
        inv_freq = 1.0 / (base ** exponents)
        attention_factor = 1.0
        if rope_type == "linear":
            inv_freq = inv_freq / params["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        elif rope_type == "yarn":
            inv_freq, attention_factor = _yarn(rot_dim, base, params, max_position)
        if params.get("freq_divisors") is not None:  # a GGUF file's rope_freqs (llama.cpp's Llama 3.1 scaling)
            inv_freq = inv_freq / torch.tensor(params["freq_divisors"], dtype=torch.float32)
        self.rot_dim, self.max_position = rot_dim, max_position
        if rope_type == "longrope":
            self.original_max = params["original_max_position_embeddings"]
            self.inv_freqs = {long: 1.0 / (torch.tensor(params["long_factor" if long else "short_factor"],
                                                         dtype=torch.float32) * base ** exponents)
                              for long in (False, True)}
            attention_factor = _longrope_factor(params, max_position)
            inv_freq = self.inv_freqs[max_position > self.original_max]
        self.attention_factor = attention_factor
        # [max_position, rot_dim]: cos | sin halves, fp32. The attention op rotates q and k with it
        # (fused into its KV store on the Triton backend); see apply_rotary.
        self.register_buffer("cos_sin", self._table(inv_freq), persistent=False)

    def _table(self, inv_freq: torch.Tensor) -> torch.Tensor:
        freqs = torch.outer(torch.arange(self.max_position, dtype=torch.float32, device=inv_freq.device), inv_freq)
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()
        return cos_sin * self.attention_factor if self.attention_factor != 1.0 else cos_sin

    def fit_context(self, max_model_len: int) -> None:
        """Longrope: the frequency set for an engine that serves up to max_model_len tokens (see the
        module's docstring); the table is rewritten in place. Other types do not depend on it."""
        if getattr(self, "inv_freqs", None) is not None:
            inv_freq = self.inv_freqs[max_model_len > self.original_max]
            self.cos_sin.copy_(self._table(inv_freq).to(self.cos_sin.device))


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
