"""Phi-3-vision / Phi-3.5-vision (`Phi3VForCausalLM`, remote code in the real world), its own
checkpoint layout:

    config.json             model_type "phi3_v": the Phi-3 decoder's fields at the top level, plus
                            `img_processor` (CLIP settings, feature layer) and `embd_layer` (HD settings)
    model-*.safetensors     model.embed_tokens / model.layers.* / model.norm / lm_head (Phi-3 names),
                            model.vision_embed_tokens.img_processor.vision_model.* (a CLIP ViT),
                            model.vision_embed_tokens.{glb_GN, sub_GN, img_projection.{0,2}.*}
    preprocessor_config.json  Phi3VImageProcessor with `num_crops` (16; Phi-3.5-vision also 4)

HD crops: an image is resized (aspect kept, at most `num_crops` crops of the tower's side S) and
padded with white to whole crops; the tower sees a global view (the whole image squeezed to S x S)
and each crop. Every crop's patch grid (CLIP layer -2, class token dropped) is merged 2x2 into
vectors of 4C; the crops are stitched into one grid; a learned `sub_GN` vector ends every row, of
the stitched grid as of the global view's; the image's tokens are [stitched rows, glb_GN, global
rows], projected by a 2-layer GELU MLP. The crop count differs per image (no padding to
num_crops + 1: only real crops go through the tower), so does the token count.

Prompts mark images `<|image_1|>`, `<|image_2|>`, ... (in order); the text between markers is
tokenized chunk by chunk with the tokenizer's special tokens, as the published processor does.
The CLIP config is fixed in the published code (ViT-L/14 at 336 px); `img_processor.vision_config`
(an extension used by tiny test checkpoints) overrides its fields.
"""
from __future__ import annotations

import json
import math
import os
import re
from typing import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from splitserve.layers.linear import Linear
from splitserve.layers.quantization.base import as_tensor, copy_checkpoint_tensor
from splitserve.layers.vision import VisionTower
from splitserve.models.vlm_base import VisionLanguageModel, build_language_model
from splitserve.multimodal.media import MediaError
from splitserve.multimodal.processor import IMAGE_MARKER, to_device_pixels

# The tower the published code hard-codes: openai/clip-vit-large-patch14-336.
CLIP_VIT_L14_336 = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                        image_size=336, patch_size=14, hidden_act="quick_gelu", layer_norm_eps=1e-5,
                        num_channels=3, projection_dim=768)
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_NUMBERED_MARKER = re.compile(r"<\|image_(\d+)\|>")
_VISION_PREFIX = "model.vision_embed_tokens."


# -- config ---------------------------------------------------------------------------------------
def load_phi3v_config(directory: str):
    """A transformers Phi3Config for the decoder, carrying the vision settings as attributes."""
    from transformers import CLIPVisionConfig, Phi3Config
    with open(os.path.join(directory, "config.json")) as f:
        raw = json.load(f)
    text = {k: v for k, v in raw.items()
            if k not in ("model_type", "architectures", "auto_map", "img_processor", "embd_layer", "transformers_version")}
    rope = text.get("rope_scaling")
    if isinstance(rope, dict) and rope.get("type") == "su":  # Phi-3-vision's name for longrope
        text["rope_scaling"] = {**{k: v for k, v in rope.items() if k != "type"}, "type": "longrope"}
    config = Phi3Config(**text)
    img = dict(raw.get("img_processor") or {})
    embd = dict(raw.get("embd_layer") or {})
    if img.get("name", "clip_vision_model") != "clip_vision_model":
        raise ValueError(f"Phi-3-vision img_processor {img.get('name')!r} is not supported (clip_vision_model is)")
    checks = {"embedding_cls": "image", "use_hd_transform": True, "with_learnable_separator": True,
              "hd_transform_order": "sub_glb", "projection_cls": "mlp"}
    for key, want in checks.items():
        if embd.get(key, want) != want:
            raise ValueError(f"Phi-3-vision embd_layer.{key}={embd[key]!r} is not supported ({want!r} is)")
    config.vision_config = CLIPVisionConfig(**{**CLIP_VIT_L14_336, **img.get("vision_config", {})})
    if img.get("image_dim_out", config.vision_config.hidden_size) != config.vision_config.hidden_size:
        raise ValueError("Phi-3-vision img_processor.image_dim_out differs from the CLIP tower's hidden size")
    config.img_processor, config.embd_layer = img, embd
    config.image_token_id = raw.get("image_token_id")
    config.architectures = ["Phi3VForCausalLM"]
    return config


# -- image processing -----------------------------------------------------------------------------
def hd_size(width: int, height: int, num_crops: int, side: int) -> tuple[int, int, int, int]:
    """(resized width, height, padded width, height) of the HD transform: the largest whole number
    of crops across the longer side such that the crops fit in num_crops; the shorter side scales
    along and is padded up to whole crops (centred)."""
    transposed = width < height
    if transposed:
        width, height = height, width
    ratio = width / height
    scale = 1
    while scale * math.ceil(scale / ratio) <= num_crops:
        scale += 1
    scale -= 1
    new_w = int(scale * side)
    new_h = int(new_w / ratio)
    if new_h < 1:
        raise MediaError(f"image of {width}x{height} is too elongated for {num_crops} HD crops")
    padded_h = int(math.ceil(new_h / side) * side)
    if transposed:
        return new_h, new_w, padded_h, new_w
    return new_w, new_h, new_w, padded_h


class Phi3VImageProcessor:
    """The published Phi3VImageProcessor in PIL + torch: `__call__(images=[img], return_tensors="pt")`
    gives pixel_values [1, 1 + crops, 3, S, S] (the global view first) and image_sizes [[H, W]],
    the padded HD size from which the model counts crops and tokens."""

    def __init__(self, num_crops: int, side: int, mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD):
        if num_crops < 1:
            raise ValueError(f"num_crops must be at least 1, got {num_crops}")
        self.num_crops, self.side = num_crops, side
        self.mean = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)

    @classmethod
    def from_directory(cls, directory: str, side: int) -> "Phi3VImageProcessor":
        path = os.path.join(directory, "preprocessor_config.json")
        cfg = {}
        if os.path.isfile(path):
            with open(path) as f:
                cfg = json.load(f)
        return cls(int(cfg.get("num_crops", 1)), side, cfg.get("image_mean") or OPENAI_CLIP_MEAN,
                   cfg.get("image_std") or OPENAI_CLIP_STD)

    def hd_image(self, img):
        """Resize and pad as the published code does, in its order: a tall image is transposed
        first, so PIL's two resampling passes (rounded to 8 bits between them) run as they do there."""
        from PIL import Image
        img = img.convert("RGB")
        transposed = img.size[0] < img.size[1]
        if transposed:
            img = img.transpose(Image.Transpose.TRANSPOSE)
        new_w, new_h, pad_w, pad_h = hd_size(img.size[0], img.size[1], self.num_crops, self.side)
        resized = img.resize((new_w, new_h), Image.BILINEAR)
        canvas = Image.new("RGB", (pad_w, pad_h), (255, 255, 255))
        canvas.paste(resized, (0, (pad_h - new_h) // 2))  # white rows above and below, the extra one below
        return canvas.transpose(Image.Transpose.TRANSPOSE) if transposed else canvas

    def __call__(self, images, return_tensors: str = "pt") -> dict:
        pixels, sizes = [], []
        s = self.side
        for img in images:
            hd = self.hd_image(img)
            x = torch.from_numpy(np.asarray(hd, dtype=np.float32) / 255.0).permute(2, 0, 1)
            x = (x - self.mean) / self.std
            h, w = x.shape[1:]
            glob = F.interpolate(x[None], size=(s, s), mode="bicubic")
            crops = x.view(3, h // s, s, w // s, s).permute(1, 3, 0, 2, 4).reshape(-1, 3, s, s)
            pixels.append(torch.cat([glob, crops]))
            sizes.append([h, w])
        if len(pixels) != 1:  # the engine processes one image at a time; crop counts differ
            raise ValueError("Phi3VImageProcessor takes one image per call")
        return {"pixel_values": pixels[0][None], "image_sizes": torch.tensor(sizes)}


# -- prompts --------------------------------------------------------------------------------------
def tokenize_phi3v_prompt(tokenizer, text: str, marker_id: int) -> list[int]:
    """Text with `<|image_N|>` markers (N = 1, 2, ... in order), or generic `<image>` markers (what
    chat content parts become, numbered in order), -> ids with one marker_id per image. Each chunk
    between markers is tokenized with the tokenizer's special tokens, as the published processor does."""
    numbered = [int(n) for n in _NUMBERED_MARKER.findall(text)]
    if numbered and IMAGE_MARKER in text:
        raise MediaError(f"the prompt mixes <|image_N|> and {IMAGE_MARKER} image markers")
    if numbered != list(range(1, len(numbered) + 1)):
        raise MediaError(f"Phi-3-vision image markers must be <|image_1|>, <|image_2|>, ... each once and in "
                         f"order; got {['<|image_%d|>' % n for n in numbered]}")
    chunks = _NUMBERED_MARKER.split(text)[::2] if numbered else text.split(IMAGE_MARKER)
    ids: list[int] = []
    for i, chunk in enumerate(chunks):
        if i:
            ids.append(marker_id)
        ids.extend(tokenizer.encode(chunk, add_special_tokens=True))
    return ids


# -- model ----------------------------------------------------------------------------------------
def merge_2x2_rowmajor(x: torch.Tensor, side: int) -> torch.Tensor:
    """[N, side*side, C] -> [N, side/2, side/2, 4C]: each 2x2 cell's vectors concatenated
    [top-left, top-right, bottom-left, bottom-right], cells in grid order."""
    n, _, c = x.shape
    half = side // 2
    return x.view(n, half, 2, half, 2, c).permute(0, 1, 3, 2, 4, 5).reshape(n, half, half, 4 * c)


class Phi3VForCausalLM(VisionLanguageModel):
    image_token = "<|image|>"  # the placeholder's token text where the tokenizer has it

    def __init__(self, config, quant_config=None):
        super().__init__()
        self.config = config
        self.language_model = build_language_model(config, quant_config, "model", "lm_head")
        vc = config.vision_config
        layer = config.img_processor.get("layer_idx", -2)
        if config.img_processor.get("type_feature", "patch") != "patch":
            raise ValueError("Phi-3-vision type_feature other than 'patch' is not supported")
        self.vision_tower = VisionTower(vc, layer)
        self.side = vc.image_size // vc.patch_size
        if self.side % 2:
            raise ValueError(f"Phi-3-vision's 2x2 merge needs an even patch grid, got {self.side}x{self.side}")
        self.crop = vc.image_size
        dim = 4 * vc.hidden_size
        self.glb_GN = nn.Parameter(torch.empty(1, 1, dim), requires_grad=False)
        self.sub_GN = nn.Parameter(torch.empty(1, 1, 1, dim), requires_grad=False)
        self.img_projection = nn.ModuleDict({"0": Linear(dim, config.hidden_size, bias=True),
                                             "2": Linear(config.hidden_size, config.hidden_size, bias=True)})
        self.image_token_id = config.image_token_id

    # -- front-end hooks (multimodal/processor.py) -------------------------------------------------
    def load_image_processor(self, directory: str) -> Phi3VImageProcessor:
        return Phi3VImageProcessor.from_directory(directory, self.crop)

    @staticmethod
    def tokenize_prompt(tokenizer, text: str, marker_id: int) -> list[int]:
        return tokenize_phi3v_prompt(tokenizer, text, marker_id)

    # -- images ------------------------------------------------------------------------------------
    def _grid(self, image_size: tuple[int, int]) -> tuple[int, int]:
        return image_size[0] // self.crop, image_size[1] // self.crop

    def num_image_tokens(self, num_tiles: int, image_size: tuple[int, int]) -> int:
        hc, wc = self._grid(image_size)
        if hc * wc + 1 != num_tiles:
            raise ValueError(f"{num_tiles} tiles do not match an HD image of {image_size}")
        m = self.side // 2
        return hc * m * (wc * m + 1) + 1 + m * (m + 1)

    def _with_newlines(self, grid: torch.Tensor) -> torch.Tensor:
        rows, _, dim = grid.shape
        newline = self.sub_GN.reshape(1, 1, dim).to(grid.dtype).expand(rows, 1, dim)
        return torch.cat([grid, newline], dim=1).reshape(-1, dim)

    def encode_images(self, items) -> list[torch.Tensor]:
        pixels = to_device_pixels(items, self._param.device, self._param.dtype)
        feats = self.vision_tower(pixels)[:, 1:]  # type_feature "patch": the class token dropped
        cells = merge_2x2_rowmajor(feats, self.side)  # [tiles, m, m, 4C]
        m, dim = self.side // 2, cells.shape[-1]
        seqs = []
        for item, tiles in zip(items, cells.split([it.pixel_values.shape[0] for it in items])):
            hc, wc = self._grid(item.image_size)
            stitched = tiles[1:].view(hc, wc, m, m, dim).permute(0, 2, 1, 3, 4).reshape(hc * m, wc * m, dim)
            seqs.append(torch.cat([self._with_newlines(stitched), self.glb_GN.reshape(1, dim).to(cells.dtype),
                                   self._with_newlines(tiles[0])]))
        proj = self.img_projection["2"](F.gelu(self.img_projection["0"](torch.cat(seqs))))
        return list(proj.split([s.shape[0] for s in seqs]))

    # -- weights -----------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        own = {"glb_GN": self.glb_GN, "sub_GN": self.sub_GN,
               **{f"img_projection.{n}": p for n, p in self.img_projection.named_parameters()}}

        def text_weights():
            for name, tensor in weights:
                if not name.startswith(_VISION_PREFIX):
                    yield name, tensor
                    continue
                rest = name[len(_VISION_PREFIX):]
                if rest == "wte.weight":  # the decoder's embedding, saved again under the image embedder
                    yield "model.embed_tokens.weight", tensor
                elif rest.startswith("img_processor."):  # replicated on every rank: read whole
                    filled = self.vision_tower.load_weight(rest[len("img_processor."):], as_tensor(tensor))
                    if filled:
                        loaded.add(f"vision_tower.{filled}")
                elif rest in own:
                    copy_checkpoint_tensor(own[rest], tensor, name)
                    loaded.add(rest)
                else:
                    raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(self).__name__}")

        loaded |= {f"language_model.{n}" for n in self.language_model.load_weights(text_weights())}
        return loaded
