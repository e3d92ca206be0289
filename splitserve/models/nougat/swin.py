"""The Swin Transformer encoder (transformers' `SwinModel` / `DonutSwinModel`: Donut's and Nougat's
image encoder), batchful: all images of a step in one batch.

Patch embedding (a strided convolution + LayerNorm), then stages of pre-norm layers with windowed
self-attention (windows of `window_size`^2 patches, every other layer's windows shifted by half a
window with the wrapped-around regions masked apart), a learned relative position bias per head over
the offsets inside a window, and a patch merging (2x2 neighbours concatenated, LayerNorm, linear to
twice the width) between stages. SwinModel adds a final LayerNorm; Donut's variant has none.

Kept as transformers computes it, since checkpoints were converted against it: feature maps padded
with zeros to a multiple of the window after the layer's norm (the padding is attended to, not
masked), the shift mask's -100, a stage whose map is no larger than a window attending over the
whole map unshifted. Parameter names mirror transformers' except query/key/value, merged into one
projection (`qkv`, one matmul); loading routes them to its shards.

The linear layers are splitserve/layers' plain ones, float and whole on every tensor-parallel rank,
as the engine's other vision towers (layers/vision.py): the encoder runs once per request, and the
decoder behind it is what quantization and tensor parallelism split.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.layers.activation import activation
from splitserve.layers.linear import Linear, MergedLinear
from splitserve.layers.quantization.base import copy_checkpoint_tensor


def _pair(v) -> tuple[int, int]:
    return (int(v[0]), int(v[1])) if isinstance(v, (list, tuple)) else (int(v), int(v))


def swin_output_grid(config, height: int, width: int) -> tuple[int, int]:
    """The last stage's feature map (rows, columns) for an image of height x width pixels."""
    ph, pw = _pair(config.patch_size)
    h, w = -(-height // ph), -(-width // pw)
    for _ in range(len(config.depths) - 1):
        h, w = (h + 1) // 2, (w + 1) // 2
    return h, w


class _PatchEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.patch_size = _pair(config.patch_size)
        self.projection = nn.Conv2d(config.num_channels, config.embed_dim, self.patch_size, self.patch_size)


class _Embeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        if getattr(config, "use_absolute_embeddings", False):
            raise ValueError("Swin use_absolute_embeddings=True is not supported")
        self.patch_embeddings = _PatchEmbeddings(config)
        self.norm = nn.LayerNorm(config.embed_dim)

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        ph, pw = self.patch_embeddings.patch_size
        H, W = pixels.shape[-2:]
        pixels = F.pad(pixels, (0, (-W) % pw, 0, (-H) % ph))
        x = self.patch_embeddings.projection(pixels)  # [N, C, h, w]
        h, w = x.shape[-2:]
        return self.norm(x.flatten(2).transpose(1, 2)), h, w


class _SelfAttention(nn.Module):
    """query/key/value (merged: `qkv`) and the relative position bias table of one layer."""

    def __init__(self, config, dim: int, heads: int):
        super().__init__()
        ws = config.window_size
        self.qkv = MergedLinear(dim, {"query": dim, "key": dim, "value": dim}, bias=config.qkv_bias)
        self.ckpt_children = {"query": "qkv", "key": "qkv", "value": "qkv"}  # checkpoint name -> merged layer
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * ws - 1) ** 2, heads))
        # index[i, j]: the table row of the offset between window positions i and j
        coords = torch.stack(torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (ws - 1)
        self.register_buffer("index", rel[..., 0] * (2 * ws - 1) + rel[..., 1], persistent=False)


class _Named(nn.Module):
    def __init__(self, **children: nn.Module):
        super().__init__()
        for name, child in children.items():
            setattr(self, name, child)


class _Attention(nn.Module):
    def __init__(self, config, dim: int, heads: int):
        super().__init__()
        setattr(self, "self", _SelfAttention(config, dim, heads))  # transformers' name: attention.self
        self.output = _Named(dense=Linear(dim, dim, bias=True))


class SwinLayer(nn.Module):
    def __init__(self, config, dim: int, heads: int, shift: bool):
        super().__init__()
        eps = config.layer_norm_eps
        self.heads, self.window, self.shifted = heads, config.window_size, shift
        self.layernorm_before = nn.LayerNorm(dim, eps=eps)
        self.attention = _Attention(config, dim, heads)
        self.layernorm_after = nn.LayerNorm(dim, eps=eps)
        hidden = int(config.mlp_ratio * dim)
        self.intermediate = _Named(dense=Linear(dim, hidden, bias=True))
        self.output = _Named(dense=Linear(hidden, dim, bias=True))
        self.act = activation(config.hidden_act)

    def _shift_mask(self, hp: int, wp: int, ws: int, shift: int, device) -> torch.Tensor:
        """[windows, ws*ws, ws*ws]: 0 within one region of the rolled map, -100 across regions."""
        def regions(n):
            i = torch.arange(n, device=device)
            return (i >= n - ws).long() + (i >= n - shift).long()
        label = (regions(hp)[:, None] * 3 + regions(wp)[None, :]).float()
        label = label.view(hp // ws, ws, wp // ws, ws).transpose(1, 2).reshape(-1, ws * ws)
        diff = label[:, None, :] - label[:, :, None]
        return torch.where(diff != 0, -100.0, 0.0)

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        N, _, C = x.shape
        ws, shift = self.window, (self.window // 2 if self.shifted else 0)
        if min(h, w) <= ws:  # the whole map fits a window: one unshifted window over it
            if min(h, w) < ws:
                raise ValueError(f"Swin feature map {h}x{w} is smaller than its window {ws} (as in transformers, "
                                 f"whose relative position table is sized for the window); use larger images")
            shift = 0
        attn = self.attention.self
        y = self.layernorm_before(x).view(N, h, w, C)
        y = F.pad(y, (0, 0, 0, (-w) % ws, 0, (-h) % ws))
        hp, wp = y.shape[1:3]
        if shift:
            y = torch.roll(y, (-shift, -shift), dims=(1, 2))
        win = y.view(N, hp // ws, ws, wp // ws, ws, C).transpose(2, 3).reshape(-1, ws * ws, C)
        nW, T, D, H = (hp // ws) * (wp // ws), ws * ws, C // self.heads, self.heads
        # (window, head) pairs as the attention's heads: one mask of [windows * heads, T, T] serves
        # every image of the batch (broadcast), never one copy per image.
        q, k, v = (t.view(N, nW, T, H, D).permute(0, 1, 3, 2, 4).reshape(N, nW * H, T, D)
                   for t in attn.qkv.split(attn.qkv(win)))
        bias = attn.relative_position_bias_table[attn.index].permute(2, 0, 1)  # [heads, T, T]
        mask = bias[None].expand(nW, -1, -1, -1)
        if shift:
            mask = mask + self._shift_mask(hp, wp, ws, shift, x.device)[:, None].to(mask.dtype)
        mask = mask.reshape(1, nW * H, T, T).to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # scale 1/sqrt(D), as transformers
        out = out.view(N, nW, H, T, D).permute(0, 1, 3, 2, 4).reshape(N * nW, T, C)
        out = self.attention.output.dense(out)
        out = out.view(N, hp // ws, wp // ws, ws, ws, C).transpose(2, 3).reshape(N, hp, wp, C)
        if shift:
            out = torch.roll(out, (shift, shift), dims=(1, 2))
        x = x + out[:, :h, :w].reshape(N, h * w, C)
        return x + self.output.dense(self.act(self.intermediate.dense(self.layernorm_after(x))))


class PatchMerging(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.reduction = Linear(4 * dim, 2 * dim, bias=False)
        self.norm = nn.LayerNorm(4 * dim)

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        N, _, C = x.shape
        x = F.pad(x.view(N, h, w, C), (0, 0, 0, w % 2, 0, h % 2))
        # transformers' order: (row 0, col 0), (row 1, col 0), (row 0, col 1), (row 1, col 1)
        x = torch.cat([x[:, r::2, c::2] for c in range(2) for r in range(2)], dim=-1)
        return self.reduction(self.norm(x.reshape(N, -1, 4 * C)))


class SwinStage(nn.Module):
    def __init__(self, config, dim: int, depth: int, heads: int, merge: bool):
        super().__init__()
        self.blocks = nn.ModuleList(SwinLayer(config, dim, heads, shift=i % 2 == 1) for i in range(depth))
        self.downsample = PatchMerging(dim) if merge else None


class SwinEncoder(nn.Module):
    """pixels [N, channels, H, W] -> last hidden states [N, rows * columns, hidden_size]."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        if config.model_type not in ("swin", "donut-swin"):
            raise ValueError(f"Swin encoder: unsupported model_type {config.model_type!r}")
        n = len(config.depths)
        self.embeddings = _Embeddings(config)
        self.encoder = _Named(layers=nn.ModuleList(
            SwinStage(config, config.embed_dim * 2 ** i, config.depths[i], config.num_heads[i], i < n - 1)
            for i in range(n)))
        self.hidden_size = config.embed_dim * 2 ** (n - 1)
        # SwinModel ends with a LayerNorm; Donut's Swin does not.
        self.layernorm = nn.LayerNorm(self.hidden_size, eps=config.layer_norm_eps) if config.model_type == "swin" else None

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x, h, w = self.embeddings(pixels)
        for stage in self.encoder.layers:
            for layer in stage.blocks:
                x = layer(x, h, w)
            if stage.downsample is not None:
                x = stage.downsample(x, h, w)
                h, w = (h + 1) // 2, (w + 1) // 2
        return x if self.layernorm is None else self.layernorm(x)

    def load_weight(self, name: str, tensor: torch.Tensor) -> str | None:
        """Places one checkpoint tensor (a name under the encoder) in its parameter, a linear layer
        (query/key/value: the shard of the merged `qkv`) or a plain one; returns the parameter's
        name, or None for a tensor recomputed here (relative_position_index)."""
        if name.endswith("relative_position_index"):
            return None
        module_name, _, param = name.rpartition(".")
        parent, _, child = module_name.rpartition(".")
        modules = dict(self.named_modules())
        merged = getattr(modules.get(parent), "ckpt_children", {}).get(child)
        if merged is not None:
            module_name, shard = f"{parent}.{merged}", child
        else:
            shard = None
        module = modules.get(module_name)
        if isinstance(module, Linear):
            try:
                module.load(param, tensor, shard)
            except ValueError as e:
                raise ValueError(f"Swin tensor {name!r}: {e}") from None
            return f"{module_name}.{param}"
        params = dict(self.named_parameters())
        if name not in params:
            raise ValueError(f"unexpected Swin encoder checkpoint tensor {name!r}")
        copy_checkpoint_tensor(params[name], tensor, f"Swin tensor {name!r}")
        return name
