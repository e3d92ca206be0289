"""Phi-3-vision / Phi-3.5-vision (`Phi3VForCausalLM`, remote code in the real world), its own
checkpoint layout (config reader: config.py; image processor, prompts and token counts: processor.py):

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

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.layers.linear import Linear
from splitserve.layers.vision import VisionTower
from splitserve.models.phi3v.processor import Phi3VProcessing
from splitserve.models.vlm_base import VisionLanguageModel, build_language_model
from splitserve.models.weights import WeightRoute, load_routed_weights
from splitserve.multimodal.processor import to_device_pixels

_VISION_PREFIX = "model.vision_embed_tokens."
# Checkpoint name -> module: the image embedder's tensors (the tower read whole on every rank, the
# separators and projection the model's own; `wte` is the decoder's embedding saved again), every
# other tensor the decoder's under its Phi-3 name.
PHI3V_WEIGHTS = (
    WeightRoute(_VISION_PREFIX + "wte.weight", "text", "model.embed_tokens.weight"),
    WeightRoute(_VISION_PREFIX + "img_processor.", "tower", "vision_tower"),
    WeightRoute(_VISION_PREFIX + "glb_GN", "param", "glb_GN"),
    WeightRoute(_VISION_PREFIX + "sub_GN", "param", "sub_GN"),
    WeightRoute(_VISION_PREFIX + "img_projection.", "param", "img_projection."),
    WeightRoute(_VISION_PREFIX, "refuse"),
    WeightRoute("", "text"),
)


# -- model ----------------------------------------------------------------------------------------
def merge_2x2_rowmajor(x: torch.Tensor, side: int) -> torch.Tensor:
    """[N, side*side, C] -> [N, side/2, side/2, 4C]: each 2x2 cell's vectors concatenated
    [top-left, top-right, bottom-left, bottom-right], cells in grid order."""
    n, _, c = x.shape
    half = side // 2
    return x.view(n, half, 2, half, 2, c).permute(0, 1, 3, 2, 4, 5).reshape(n, half, half, 4 * c)


class Phi3VForCausalLM(Phi3VProcessing, VisionLanguageModel):
    def __init__(self, config, quant_config=None):
        super().__init__()
        self.config = config
        self.language_model = build_language_model(config, quant_config, "model", "lm_head")
        vc = config.vision_config
        layer = config.img_processor.get("layer_idx", -2)
        if config.img_processor.get("type_feature", "patch") != "patch":
            raise ValueError("Phi-3-vision type_feature other than 'patch' is not supported")
        self.vision_tower = VisionTower(vc, layer)
        self.init_processing(config)  # side, crop, image token (processor.py)
        dim = 4 * vc.hidden_size
        self.glb_GN = nn.Parameter(torch.empty(1, 1, dim), requires_grad=False)
        self.sub_GN = nn.Parameter(torch.empty(1, 1, 1, dim), requires_grad=False)
        self.img_projection = nn.ModuleDict({"0": Linear(dim, config.hidden_size, bias=True),
                                             "2": Linear(config.hidden_size, config.hidden_size, bias=True)})

    # -- images ------------------------------------------------------------------------------------
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
        return load_routed_weights(self, weights, PHI3V_WEIGHTS)
