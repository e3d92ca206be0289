"""Tiny random vision-language checkpoints saved by Hugging Face transformers, and their references."""
from __future__ import annotations

import json
import os

import numpy as np
import torch
import transformers

from splitserve.loading.resolve import load_tokenizer

IMAGE = "<image>"
TILE = 56      # vision tower input side: 4x4 patches of 14 px
PATCH = 14


def pil_class(name: str):
    """The PIL/numpy image processor: `<Name>Pil` on transformers 5, the slow `<Name>` on 4.x."""
    return getattr(transformers, f"{name}Pil", None) or getattr(transformers, name)


def mm_tokenizer():
    """The default model's tokenizer plus an <image> special token, as llava-hf adds one."""
    tok = load_tokenizer(None)
    tok.add_special_tokens({"additional_special_tokens": [IMAGE]})
    return tok


def random_image(seed: int, size: tuple[int, int]):
    from PIL import Image
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8), "RGB")


def text_config(tokenizer, **overrides) -> dict:
    kw = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
              rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=tokenizer.bos_token_id,
              eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    kw.update(overrides)
    return kw


def vision_config(tower: str) -> dict:
    kw = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              image_size=TILE, patch_size=PATCH, initializer_range=0.2)
    kw["model_type"] = "clip_vision_model" if tower == "clip" else "siglip_vision_model"
    return kw


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Larger-than-default random weights, so that images actually move the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))


def make_tiny_llava_dir(path, tokenizer, tower: str = "clip", anyres: bool = False, seed: int = 0) -> str:
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaNextConfig, LlavaNextForConditionalGeneration
    image_token = tokenizer.convert_tokens_to_ids(IMAGE)
    strategy = "default" if tower == "clip" else "full"
    kw = dict(text_config=text_config(tokenizer), vision_config=vision_config(tower), image_token_index=image_token,
              vision_feature_layer=-2, vision_feature_select_strategy=strategy, projector_hidden_act="gelu")
    mean, std = [0.48, 0.45, 0.40], [0.27, 0.26, 0.28]
    if anyres:
        pins = [[TILE, 2 * TILE], [2 * TILE, TILE], [2 * TILE, 2 * TILE]]
        config = LlavaNextConfig(image_grid_pinpoints=pins, **kw)
        model = LlavaNextForConditionalGeneration(config)
        processor = pil_class("LlavaNextImageProcessor")(
            size={"shortest_edge": TILE}, crop_size={"height": TILE, "width": TILE}, image_grid_pinpoints=pins,
            image_mean=mean, image_std=std)
    else:
        config = LlavaConfig(**kw)
        model = LlavaForConditionalGeneration(config)
        name = "CLIPImageProcessor" if tower == "clip" else "SiglipImageProcessor"
        size = {"shortest_edge": TILE} if tower == "clip" else {"height": TILE, "width": TILE}
        extra = {"crop_size": {"height": TILE, "width": TILE}} if tower == "clip" else {}
        processor = pil_class(name)(size=size, image_mean=mean, image_std=std, **extra)
    _randomize(model, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)


def hf_processor(path, tokenizer, tower: str, anyres: bool):
    """The HF processor (image processor + placeholder expansion) for a tiny checkpoint."""
    from splitserve.multimodal.processor import load_image_processor
    cls = transformers.LlavaNextProcessor if anyres else transformers.LlavaProcessor
    return cls(image_processor=load_image_processor(str(path)), tokenizer=tokenizer, patch_size=PATCH,
               vision_feature_select_strategy="default" if tower == "clip" else "full",
               num_additional_image_tokens=1 if tower == "clip" else 0, image_token=IMAGE)


@torch.inference_mode()
def hf_greedy_mm(model, inputs: dict, max_new_tokens: int) -> tuple[list[int], list[float]]:
    n = inputs["input_ids"].shape[1]
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    tokens = out.sequences[0, n:].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
    return tokens, logprobs


# -- VILA layout ---------------------------------------------------------------------------------------
def vila_projector_state(vision_dim: int, text_dim: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"layers.1.weight": 1 + 0.1 * torch.randn(4 * vision_dim, generator=gen),
            "layers.1.bias": 0.1 * torch.randn(4 * vision_dim, generator=gen),
            "layers.2.weight": 0.2 * torch.randn(text_dim, 4 * vision_dim, generator=gen),
            "layers.2.bias": 0.1 * torch.randn(text_dim, generator=gen),
            "layers.4.weight": 0.2 * torch.randn(text_dim, text_dim, generator=gen),
            "layers.4.bias": 0.1 * torch.randn(text_dim, generator=gen)}


def make_tiny_vila_dir(path, tokenizer, image_size: int = 70, seed: int = 0) -> str:
    """VILA1.5's layout: llm/ (Llama + tokenizer), vision_tower/ (SigLIP + processor), mm_projector/.
    70 px / 14 = 5x5 patches: an odd side, so the 2x2 merge has to pad."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM, SiglipVisionConfig, SiglipVisionModel
    path = str(path)
    tc = text_config(tokenizer)
    tc.pop("model_type")
    llm = LlamaForCausalLM(LlamaConfig(**tc))
    vc = vision_config("siglip")
    vc.pop("model_type")
    vc["image_size"] = image_size
    tower = SiglipVisionModel(SiglipVisionConfig(**vc))
    _randomize(llm, seed)
    _randomize(tower, seed + 1)
    llm.save_pretrained(os.path.join(path, "llm"))
    tokenizer.save_pretrained(os.path.join(path, "llm"))
    tower.save_pretrained(os.path.join(path, "vision_tower"))
    pil_class("SiglipImageProcessor")(size={"height": image_size, "width": image_size}).save_pretrained(
        os.path.join(path, "vision_tower"))
    os.makedirs(os.path.join(path, "mm_projector"), exist_ok=True)
    save_file(vila_projector_state(vc["hidden_size"], tc["hidden_size"], seed + 2),
              os.path.join(path, "mm_projector", "model.safetensors"))
    with open(os.path.join(path, "mm_projector", "config.json"), "w") as f:
        json.dump({"model_type": "v2l_projector", "mm_projector_type": "mlp_downsample",
                   "architectures": ["MultimodalProjector"]}, f)
    root = {"architectures": ["LlavaLlamaModel"], "model_type": "llava_llama", "hidden_size": tc["hidden_size"],
            "mm_hidden_size": vc["hidden_size"], "mm_projector_type": "mlp_downsample",
            "mm_vision_select_layer": -2, "mm_vision_select_feature": "cls_patch", "image_aspect_ratio": "resize",
            "llm_cfg": {"_name_or_path": "./llm"}, "vision_tower_cfg": {"_name_or_path": "./vision_tower"},
            "mm_projector_cfg": {"_name_or_path": "./mm_projector"}}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(root, f)
    return path
