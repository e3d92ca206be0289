"""NeVA and Video NeVA (NVIDIA NeMo): a CLIP ViT + MLP projector in front of an NVGPT / Nemotron
decoder, read from a `.nemo` archive (loading/nemo_archive.py unpacks it,
loading/neva_nemo.py converts it and reads its config).

- Decoder: the engine's `nemotron` family (LayerNorm1P, squared-ReLU up/down MLP, partial rotary),
  configured from NeMo's model_config.yaml. NeMo's fused `query_key_value` is laid out per query
  group: [the group's query heads, its key head, its value head] (Megatron's GQA layout); it is cut
  into q, k and v here.
- Vision: the HF CLIP named by `mm_cfg.vision_encoder.from_pretrained` (a local directory, absolute or
  relative to the .nemo file, or a cached hub repo; tower weights inside the checkpoint take
  precedence), features of `vision_select_layer` (-2) without the class token, then
  `mm_mlp_adapter_type` mlp2x_gelu (linear, GELU, linear) or linear.
- An image is `image_token_len` = (size / patch)^2 placeholder tokens, all replaced by its features
  (NeMo's run without im_start/im_end: the start and end slots carry features too, as in
  TensorRT-LLM's NeVA). A video is `num_frames` frames, each through the same tower and projector,
  their runs back to back in frame order (Video NeVA).
- Prompts: `<image>` / `<video>` in text; chat through the conversation template the config names
  (`data.conv_template`): nvgpt, nv_steerlm, v1 / vicuna_v1 / llava_v1, plain.
"""
from __future__ import annotations

import json
import os
import re
from typing import Iterable, Iterator

import torch

from splitserve.layers.linear import Linear
from splitserve.layers.quantization.base import as_tensor, copy_checkpoint_tensor
from splitserve.layers.vision import MlpProjector, VisionTower
from splitserve.models.vlm_base import VisionLanguageModel, build_language_model
from splitserve.loading.nemo_archive import iter_merged
from splitserve.models.neva.processor import NevaProcessing


# -- weights ------------------------------------------------------------------------------------------
def iter_neva_weights(directory: str, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The .nemo's tensors (tensor-parallel shards merged), then the vision tower's own files where
    the checkpoint has no tower weights (NeVA freezes and usually omits it)."""
    with open(os.path.join(directory, "config.json")) as f:
        info = json.load(f)
    has_tower = False
    for name, tensor in iter_merged([os.path.join(directory, w) for w in info["weights"]]):
        has_tower |= "vision_encoder." in name
        yield name, tensor
    if not has_tower:
        tower = info.get("vision_tower_dir")
        for name, tensor in _tower_files(tower):
            yield f"vision_encoder.{name}", tensor


def _tower_files(tower: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The vision half of an HF CLIP directory: a CLIPVisionModel's, or a whole CLIPModel's
    (openai/clip-vit-large-patch14-336, which NeVA names) without its text side."""
    from splitserve.loading.safetensors_io import iter_safetensors
    if any(f.endswith(".safetensors") for f in os.listdir(tower)):
        weights = iter_safetensors(tower)
    else:
        path = os.path.join(tower, "pytorch_model.bin")
        if not os.path.isfile(path):
            raise ValueError(f"the vision tower directory {tower} has no weights (*.safetensors or "
                             f"pytorch_model.bin) and the .nemo checkpoint holds none")
        weights = torch.load(path, map_location="cpu", mmap=True, weights_only=True).items()
    for name, tensor in weights:
        if not name.startswith(("text_model.", "text_projection.", "visual_projection.", "logit_scale")):
            yield name, tensor


_LAYER = re.compile(r"^(?:language_model\.encoder|decoder)\.layers\.(\d+)\.(.+)$")
_LAYER_NAMES = {  # NeMo (legacy, then mcore) -> HF Nemotron, within a layer
    "input_layernorm": "input_layernorm", "self_attention.linear_qkv.layer_norm": "input_layernorm",
    "post_attention_layernorm": "post_attention_layernorm", "mlp.linear_fc1.layer_norm": "post_attention_layernorm",
    "self_attention.dense": "self_attn.o_proj", "self_attention.linear_proj": "self_attn.o_proj",
    "mlp.dense_h_to_4h": "mlp.up_proj", "mlp.linear_fc1": "mlp.up_proj",
    "mlp.dense_4h_to_h": "mlp.down_proj", "mlp.linear_fc2": "mlp.down_proj",
}
_TOP_NAMES = {
    "language_model.embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "language_model.encoder.final_layernorm.weight": "model.norm.weight",
    "language_model.encoder.final_layernorm.bias": "model.norm.bias",
    "decoder.final_layernorm.weight": "model.norm.weight", "decoder.final_layernorm.bias": "model.norm.bias",
    "language_model.output_layer.weight": "lm_head.weight", "output_layer.weight": "lm_head.weight",
}


def split_grouped_qkv(t: torch.Tensor, heads: int, groups: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """Megatron's fused QKV rows [group][q heads of the group, k, v] -> (q, k, v) rows."""
    per = heads // groups
    w = t.reshape(groups, per + 2, head_dim, *t.shape[1:])
    rest = t.shape[1:]
    return (w[:, :per].reshape(heads * head_dim, *rest), w[:, per].reshape(groups * head_dim, *rest),
            w[:, per + 1].reshape(groups * head_dim, *rest))


class NevaForCausalLM(NevaProcessing, VisionLanguageModel):
    iter_weights = staticmethod(iter_neva_weights)

    def __init__(self, config, quant_config=None):
        super().__init__()
        self.config = config
        neva = config.neva
        self.layernorm1p_stored = neva["norm"] == "layernorm1p"
        self.language_model = build_language_model(config, quant_config, "model", "lm_head")
        self.vision_tower = VisionTower(config.vision_config, neva["vision_select_layer"], class_token=True)
        text, vis = config.hidden_size, config.vision_config.hidden_size
        if neva["adapter"] == "mlp2x_gelu":
            self.mm_projector = MlpProjector(vis, text, "gelu", True)
        else:
            self.mm_projector = Linear(vis, text, bias=True)
        self.init_processing(config)  # skip_first, token counts, frames (processor.py)

    # -- encoding ----------------------------------------------------------------------------------
    def tile_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, tokens, text hidden]: images and videos alike (a video's tiles are its frames)."""
        return self.mm_projector(self.vision_tower(pixel_values)[:, self.skip_first:])

    # -- weights -----------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        c = self.config
        projector = dict(self.mm_projector.named_parameters())

        def text_weights():
            for full, tensor in weights:
                name = full[len("model."):] if full.startswith("model.") else full
                if "vision_encoder." in name:  # in the checkpoint, or the tower's own files
                    rest = name.split("vision_encoder.", 1)[1]
                    filled = self.vision_tower.load_weight(rest, as_tensor(tensor))
                    if filled:
                        loaded.add(f"vision_tower.{filled}")
                elif "mm_projector." in name:
                    index, _, param = name.split("mm_projector.", 1)[1].partition(".")
                    key = {"0": "linear_1", "2": "linear_2"}.get(index) if isinstance(self.mm_projector, MlpProjector) \
                        else ("" if index in ("0", "") else None)
                    target = f"{key}.{param}" if key else param
                    if key is None or target not in projector:
                        raise ValueError(f"NeVA projector tensor {full!r} matches no parameter "
                                         f"({c.neva['adapter']} projector)")
                    copy_checkpoint_tensor(projector[target], tensor, full)
                    loaded.add(f"mm_projector.{target}")
                elif name in _TOP_NAMES:
                    yield _TOP_NAMES[name], self._norm_value(_TOP_NAMES[name], tensor)
                elif (m := _LAYER.match(name)) is not None:
                    yield from self._layer_tensors(int(m.group(1)), m.group(2), tensor, full)
                elif name.endswith("rotary_pos_emb.inv_freq"):
                    continue  # recomputed from rotary_base
                else:
                    raise ValueError(f"checkpoint tensor {full!r} matches no parameter of NeVA")

        loaded |= {f"language_model.{n}" for n in self.language_model.load_weights(text_weights())}
        return loaded

    def _norm_value(self, hf_name: str, tensor):
        """LayerNorm1P stores w - 1; a plain LayerNorm checkpoint stores w."""
        if "norm.weight" in hf_name and not self.layernorm1p_stored:
            return as_tensor(tensor) - 1
        return tensor

    def _layer_tensors(self, i: int, rel: str, tensor, full: str):
        module, _, param = rel.rpartition(".")
        if param.startswith("layer_norm_"):  # mcore's fused norm: linear_qkv.layer_norm_weight
            module, param = f"{module}.layer_norm", param[len("layer_norm_"):]
        prefix = f"model.layers.{i}."
        if module in ("self_attention.query_key_value", "self_attention.linear_qkv"):
            c = self.config
            q, k, v = split_grouped_qkv(as_tensor(tensor), c.num_attention_heads, c.num_key_value_heads, c.head_dim)
            for proj, t in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                yield f"{prefix}self_attn.{proj}.{param}", t
            return
        if module not in _LAYER_NAMES:
            raise ValueError(f"checkpoint tensor {full!r} matches no parameter of NeVA's decoder")
        hf = f"{prefix}{_LAYER_NAMES[module]}.{param}"
        yield hf, self._norm_value(hf, tensor)
