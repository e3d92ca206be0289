"""Vision towers (CLIP ViT, SigLIP) and the projectors that map their features into the decoder's space.

These are batchful layers like the decoder's: they take a flat batch of images (or image tiles)
[N, 3, H, W], all images of a step together, and never look at which request an image belongs to.
Attention inside a tower is bidirectional over one image's patches, so a plain batched SDPA suffices.

Parameter names follow the Hugging Face checkpoints (`embeddings.*`, `pre_layrnorm.*`,
`encoder.layers.N.*`), so weights stream in by name; q/k/v are merged into one projection.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.layers.linear import Linear, MergedLinear
from splitserve.layers.quantization.base import copy_checkpoint_tensor

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def layer_norm(dim: int, eps: float) -> nn.LayerNorm:
    """A LayerNorm with frozen parameters (inference only)."""
    norm = nn.LayerNorm(dim, eps=eps)
    norm.weight.requires_grad_(False)
    norm.bias.requires_grad_(False)
    return norm


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv_proj = MergedLinear(dim, {"q": dim, "k": dim, "v": dim}, bias=True)
        self.out_proj = Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, D = x.shape
        q, k, v = (t.view(B, L, self.num_heads, self.head_dim).transpose(1, 2)
                   for t in self.qkv_proj.split(self.qkv_proj(x)))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(B, L, D))


class VisionEncoderLayer(nn.Module):
    """A pre-norm ViT layer; `self_attn` is CLIP's attention unless a tower brings its own (BLIP-2's
    merged-qkv attention)."""

    def __init__(self, config, self_attn: nn.Module | None = None):
        super().__init__()
        dim = config.hidden_size
        self.layer_norm1 = layer_norm(dim, config.layer_norm_eps)
        self.self_attn = self_attn if self_attn is not None else VisionAttention(dim, config.num_attention_heads)
        self.layer_norm2 = layer_norm(dim, config.layer_norm_eps)
        self.mlp = nn.Module()
        self.mlp.fc1 = Linear(dim, config.intermediate_size, bias=True)
        self.mlp.fc2 = Linear(config.intermediate_size, dim, bias=True)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp.fc2(self.act(self.mlp.fc1(self.layer_norm2(x))))


class VisionEmbeddings(nn.Module):
    """Patchify by a strided conv, add learned positions; CLIP also prepends a class token."""

    def __init__(self, config, class_token: bool):
        super().__init__()
        dim = config.hidden_size
        self.patch_embedding = nn.Conv2d(config.num_channels, dim, config.patch_size, config.patch_size,
                                         bias=not class_token)  # CLIP's conv has no bias, SigLIP's does
        self.patch_embedding.requires_grad_(False)
        num_positions = (config.image_size // config.patch_size) ** 2 + int(class_token)
        self.class_embedding = nn.Parameter(torch.empty(dim), requires_grad=False) if class_token else None
        self.position_embedding = nn.Embedding(num_positions, dim)
        self.position_embedding.weight.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        return x + self.position_embedding.weight


class VisionTower(nn.Module):
    """CLIP ViT or SigLIP vision encoder returning the hidden states of chosen layers.

    `feature_layers` index the HF `hidden_states` tuple (0 = the embeddings, i = after layer i,
    negative from the end). Only the layers up to the deepest one asked for are built and run:
    LLaVA takes the second-to-last layer, so the last layer (and the post-norm) are dead weight.
    """

    def __init__(self, config, feature_layers: int | list[int], class_token: bool | None = None):
        """class_token: CLIP's layout (class token, bias-free patch conv, pre-norm); None: by model_type."""
        super().__init__()
        self.is_clip = config.model_type in ("clip_vision_model", "clip") if class_token is None else class_token
        total = config.num_hidden_layers
        layers = [feature_layers] if isinstance(feature_layers, int) else list(feature_layers)
        self.feature_layers = [i if i >= 0 else total + 1 + i for i in layers]
        if any(not 0 <= i <= total for i in self.feature_layers):
            raise ValueError(f"vision feature layer {feature_layers} is out of range for {total} layers")
        self.embeddings = VisionEmbeddings(config, class_token=self.is_clip)
        self.pre_layrnorm = layer_norm(config.hidden_size, config.layer_norm_eps) if self.is_clip else None
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(VisionEncoderLayer(config) for _ in range(max(self.feature_layers)))
        self.num_patches = (config.image_size // config.patch_size) ** 2

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, tokens, hidden * len(feature_layers)] (tokens include CLIP's class token)."""
        x = self.embeddings(pixel_values)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        picked = {0: x} if 0 in self.feature_layers else {}
        for i, layer in enumerate(self.encoder.layers, start=1):
            x = layer(x)
            if i in self.feature_layers:
                picked[i] = x
        feats = [picked[i] for i in self.feature_layers]
        return feats[0] if len(feats) == 1 else torch.cat(feats, dim=-1)

    _STACKED = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}
    # Parts of HF vision checkpoints this tower never runs: the post-norm and pooling head after
    # the last layer, and the position-id buffer older checkpoints saved.
    _UNUSED = re.compile(r"^(post_layernorm|head)\.|^embeddings\.position_ids$")

    def load_weight(self, name: str, tensor: torch.Tensor) -> str | None:
        """Loads one HF-named tensor (prefix `vision_model.` optional); returns the parameter name
        filled, or None for weights this tower deliberately does not use (post-norm, pooling head,
        layers past the deepest feature layer). Any other name is an error."""
        if name.startswith("vision_model."):
            name = name[len("vision_model."):]
        layer = re.match(r"encoder\.layers\.(\d+)\.", name)
        if self._UNUSED.search(name) or (layer and int(layer.group(1)) >= len(self.encoder.layers)):
            return None
        module_name, _, param_name = name.rpartition(".")
        parent, _, leaf = module_name.rpartition(".")
        if leaf in self._STACKED:
            target = f"{parent}.qkv_proj"
            module = dict(self.named_modules()).get(target)
            if module is None:
                raise ValueError(f"vision tower tensor {name!r} matches no layer")
            module.load(param_name, tensor, self._STACKED[leaf])
            return f"{target}.{param_name}"
        param = dict(self.named_parameters()).get(name)
        if param is None:
            raise ValueError(f"vision tower tensor {name!r} matches no parameter (the vision tower is not "
                             f"quantized)")
        copy_checkpoint_tensor(param, tensor, f"vision tower {name}")
        return name


class MlpProjector(nn.Module):
    """LLaVA's projector: linear -> activation -> linear, per feature vector."""

    def __init__(self, in_dim: int, out_dim: int, act: str = "gelu", bias: bool = True):
        super().__init__()
        self.linear_1 = Linear(in_dim, out_dim, bias=bias)
        self.linear_2 = Linear(out_dim, out_dim, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def merge_2x2_neighbours(x: torch.Tensor) -> torch.Tensor:
    """[N, S*S, C] patch features (row-major S x S grid) -> [N, ceil(S/2)^2, 4C].

    VILA's downsampling: the grid is zero-padded to even sides, and each 2x2 cell becomes one token
    whose vector is [top-left, top-right, bottom-left, bottom-right]. The output tokens walk the
    cells column by column (cell column outer, cell row inner), which is the order VILA's
    reshape/permute sequence produces and its trained weights expect.
    """
    n, length, c = x.shape
    side = int(round(length ** 0.5))
    if side * side != length:
        raise ValueError(f"{length} patch features do not form a square grid")
    grid = x.view(n, side, side, c)
    even = side + side % 2
    if even != side:
        grid = F.pad(grid, (0, 0, 0, 1, 0, 1))  # one zero column (dim 2) and one zero row (dim 1)
    half = even // 2
    # [n, row_cell, dr, col_cell, dc, c] -> [n, col_cell, row_cell, dr, dc, c]
    cells = grid.view(n, half, 2, half, 2, c).permute(0, 3, 1, 2, 4, 5)
    return cells.reshape(n, half * half, 4 * c)


class DownsampleMlpProjector(nn.Module):
    """VILA's `mlp_downsample` projector: 2x2 merge, LayerNorm, linear, GELU, linear.

    Parameters keep VILA's `layers.<index>` names from its nn.Sequential (index 0 is the merge,
    which has no weights)."""

    def __init__(self, vision_dim: int, text_dim: int):
        super().__init__()
        self.layers = nn.ModuleDict({
            "1": layer_norm(4 * vision_dim, 1e-5),
            "2": Linear(4 * vision_dim, text_dim, bias=True),
            "4": Linear(text_dim, text_dim, bias=True),
        })

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers["1"](merge_2x2_neighbours(x))
        return self.layers["4"](F.gelu(self.layers["2"](x)))
