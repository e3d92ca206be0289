"""An independent reference of Phi-3-vision (the published `Phi3VForCausalLM` remote code), and tiny
checkpoints in its real layout. Nothing here imports splitserve's model code.

The parts transformers has run as transformers: CLIPVisionModel (the tower) and Phi3ForCausalLM
(the decoder). What only the remote code has is re-written here from its published definition:
Phi3VImageProcessor (HD_transform, padding_336, global view, crop reshape, token count), the HD
feature transform (reshape_hd_patches_2x2merge, add_image_newline, [sub, glb_GN, global]) and
Phi3VProcessor's prompt handling (split at <|image_N|>, each chunk tokenized with special tokens,
negative ids -N as placeholders). The crop side 336 of the published code is the tower's
image_size here, so tiny towers keep the geometry's shape at a CPU-friendly size.
"""
from __future__ import annotations

import json
import os
import re

import numpy as np
import torch
import torch.nn.functional as F
import transformers

IMAGE_TOKEN = "<|image|>"
PHI3V_CHAT_TEMPLATE = ("{% for message in messages %}{{'<|' + message['role'] + '|>' + '\n' + message['content'] + "
                       "'<|end|>\n' }}{% endfor %}{% if add_generation_prompt and messages[-1]['role'] != "
                       "'assistant' %}{{- '<|assistant|>\n' -}}{% endif %}")
CROP = 56      # the tiny tower's image_size (the published 336): 4x4 patches of 14 px
PATCH = 14
MEAN = [0.48145466, 0.4578275, 0.40821073]
STD = [0.26862954, 0.26130258, 0.27577711]


def phi3v_tokenizer():
    """The default model's tokenizer with Phi-3's chat tokens, <|image|> and Phi-3-vision's template."""
    from tests.multimodal_reference import mm_tokenizer
    tok = mm_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN, "<|user|>", "<|assistant|>", "<|end|>"]})
    tok.chat_template = PHI3V_CHAT_TEMPLATE
    return tok


# -- Phi3VImageProcessor, as published (crop side = `side`) --------------------------------------------
def reference_hd_transform(img, hd_num: int, side: int):
    from PIL import Image, ImageOps
    width, height = img.size
    trans = False
    if width < height:
        img = img.transpose(Image.Transpose.TRANSPOSE)
        trans = True
        width, height = img.size
    ratio = width / height
    scale = 1
    while scale * np.ceil(scale / ratio) <= hd_num:
        scale += 1
    scale -= 1
    new_w = int(scale * side)
    new_h = int(new_w / ratio)
    img = img.resize((new_w, new_h), Image.BILINEAR)  # torchvision's resize of a PIL image
    tar = int(np.ceil(new_h / side) * side)
    top = int((tar - new_h) / 2)
    img = ImageOps.expand(img, border=(0, top, 0, tar - new_h - top), fill=(255, 255, 255))
    if trans:
        img = img.transpose(Image.Transpose.TRANSPOSE)
    return img


def reference_preprocess(img, num_crops: int, side: int = CROP) -> tuple[torch.Tensor, list[int], int]:
    """-> pixel_values [1 + crops, 3, side, side] (global view first, unpadded), [h, w], num tokens."""
    img = reference_hd_transform(img.convert("RGB"), num_crops, side)
    x = torch.tensor(np.array(img), dtype=torch.float32).permute(2, 0, 1) / 255.0  # ToTensor
    x = (x - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)  # Normalize
    glob = F.interpolate(x.unsqueeze(0).float(), size=(side, side), mode="bicubic")
    h, w = x.shape[1], x.shape[2]
    crops = x.reshape(1, 3, h // side, side, w // side, side).permute(0, 2, 4, 1, 3, 5).reshape(-1, 3, side, side)
    m = side // PATCH // 2  # the published 12
    tokens = int(((h // side) * (w // side) + 1) * m * m + 1 + (h // side + 1) * m)
    return torch.cat([glob, crops]), [h, w], tokens


# -- Phi3VProcessor's prompt handling ------------------------------------------------------------------
def reference_input_ids(tok, text: str, token_counts: list[int]) -> list[int]:
    pattern = r"<\|image_\d+\|>"
    chunks = [tok(chunk).input_ids for chunk in re.split(pattern, text)]
    image_ids = [int(s.split("|")[1].split("_")[-1]) for s in re.findall(pattern, text)]
    pads = [[-iid] * token_counts[iid - 1] for iid in image_ids]
    ids: list[int] = []
    for i, chunk in enumerate(chunks):
        ids.extend(chunk)
        if i < len(pads):
            ids.extend(pads[i])
    return ids


# -- the model ------------------------------------------------------------------------------------------
class ReferencePhi3V:
    def __init__(self, path: str):
        with open(os.path.join(path, "reference.json")) as f:
            meta = json.load(f)
        self.clip = transformers.CLIPVisionModel.from_pretrained(os.path.join(path, "reference_clip"),
                                                                 dtype=torch.float32).eval()
        self.lm = transformers.Phi3ForCausalLM.from_pretrained(os.path.join(path, "reference_lm"),
                                                               dtype=torch.float32).eval()
        glue = torch.load(os.path.join(path, "reference_glue.pt"))
        self.glb_GN, self.sub_GN = glue["glb_GN"], glue["sub_GN"]
        self.proj = glue
        self.num_crops = meta["num_crops"]

    def reshape_hd_patches_2x2merge(self, image_features, h_crop, w_crop):
        N, L, C = image_features.shape
        num_images = N // (h_crop * w_crop)
        H = int(L ** 0.5)
        return (image_features.reshape(N, H, H, C).reshape(N, H // 2, 2, H // 2, 2, C)
                .permute(0, 1, 3, 2, 4, 5).reshape(N, -1, 4 * C)
                .reshape(num_images, h_crop, w_crop, H // 2, H // 2, -1)
                .permute(0, 1, 3, 2, 4, 5).reshape(num_images, h_crop * H // 2, w_crop * H // 2, 4 * C))

    def add_image_newline(self, image_features_hd):
        num_images, h, w, hid_dim = image_features_hd.shape
        newline_embeddings = self.sub_GN.expand(num_images, h, -1, -1)
        return torch.cat([image_features_hd, newline_embeddings], dim=2).reshape(num_images, -1, hid_dim)

    @torch.inference_mode()
    def image_features(self, pixel_values: torch.Tensor, size: list[int]) -> torch.Tensor:
        """One image's projected features (Phi3ImageEmbedding.get_img_features + hd_feature_transform)."""
        side = pixel_values.shape[-1]
        hidden = self.clip(pixel_values, output_hidden_states=True).hidden_states[-2][:, 1:]
        glob = self.add_image_newline(self.reshape_hd_patches_2x2merge(hidden[:1], 1, 1))
        h_crop, w_crop = size[0] // side, size[1] // side
        sub = self.add_image_newline(self.reshape_hd_patches_2x2merge(hidden[1:1 + h_crop * w_crop], h_crop, w_crop))
        x = torch.cat([sub.squeeze(0), self.glb_GN.squeeze(0), glob[0]])
        x = F.gelu(x @ self.proj["img_projection.0.weight"].T + self.proj["img_projection.0.bias"])
        return x @ self.proj["img_projection.2.weight"].T + self.proj["img_projection.2.bias"]

    @torch.inference_mode()
    def greedy(self, tok, text: str, images: list, max_new_tokens: int) -> tuple[list[int], list[float], list[int]]:
        """-> (tokens, their logprobs, prompt ids with -N placeholders)."""
        processed = [reference_preprocess(img, self.num_crops, CROP) for img in images]
        ids = reference_input_ids(tok, text, [p[2] for p in processed])
        ids_t = torch.tensor(ids)
        embeds = self.lm.get_input_embeddings()(ids_t.clamp_min(0))
        if processed:
            feats = torch.cat([self.image_features(p[0], p[1]) for p in processed])
            embeds[ids_t < 0] = feats
        out = self.lm.generate(inputs_embeds=embeds[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=max_new_tokens, do_sample=False, output_scores=True,
                               return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
        tokens = out.sequences[0, -max_new_tokens:].tolist()
        logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
        return tokens, logprobs, ids


# -- tiny checkpoint in the real layout -----------------------------------------------------------------
def _randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))


def tiny_phi3v_config(tok, num_layers: int = 2) -> dict:
    head_dim = 16
    return {
        "architectures": ["Phi3VForCausalLM"], "model_type": "phi3_v",
        "auto_map": {"AutoConfig": "configuration_phi3_v.Phi3VConfig",
                     "AutoModelForCausalLM": "modeling_phi3_v.Phi3VForCausalLM"},
        "attention_dropout": 0.0, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
        "embd_layer": {"embedding_cls": "image", "hd_transform_order": "sub_glb", "projection_cls": "mlp",
                       "use_hd_transform": True, "with_learnable_separator": True},
        "embd_pdrop": 0.0, "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 128,
        "img_processor": {"image_dim_out": 32, "model_name": "openai/clip-vit-large-patch14-336",
                          "name": "clip_vision_model", "num_img_tokens": 4,
                          "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
                                            "num_attention_heads": 4, "image_size": CROP, "patch_size": PATCH}},
        "initializer_range": 0.02, "max_position_embeddings": 8192, "num_attention_heads": 4,
        "num_hidden_layers": num_layers, "num_key_value_heads": 2, "original_max_position_embeddings": 4096,
        "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
        "rope_scaling": {"type": "su", "short_factor": [1.0 + 0.05 * i for i in range(head_dim // 2)],
                         "long_factor": [1.5 + 0.5 * i for i in range(head_dim // 2)]},
        "tie_word_embeddings": False, "torch_dtype": "float32", "vocab_size": len(tok),
    }


def make_tiny_phi3v_dir(path, tok, num_crops: int = 4, seed: int = 0) -> str:
    """Phi-3-vision's file layout: two safetensors shards + index, config.json with img_processor /
    embd_layer, preprocessor_config.json, tokenizer. The reference's pieces (transformers CLIP and
    Phi-3 checkpoints, the glue tensors) are saved beside them under reference_*."""
    from safetensors.torch import save_file
    path = str(path)
    os.makedirs(path, exist_ok=True)
    cfg = tiny_phi3v_config(tok)
    gen = torch.Generator().manual_seed(seed)
    vc = dict(cfg["img_processor"]["vision_config"], hidden_act="quick_gelu", layer_norm_eps=1e-5)
    clip = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**vc))
    text = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "auto_map", "img_processor",
                                                     "embd_layer", "torch_dtype")}
    text["rope_scaling"] = dict(text["rope_scaling"], type="longrope")
    lm = transformers.Phi3ForCausalLM(transformers.Phi3Config(**text))
    _randomize(clip, gen)
    _randomize(lm, gen)
    dim = 4 * vc["hidden_size"]
    glue = {"glb_GN": 0.5 * torch.randn(1, 1, dim, generator=gen), "sub_GN": 0.5 * torch.randn(1, 1, 1, dim, generator=gen),
            "img_projection.0.weight": 0.2 * torch.randn(cfg["hidden_size"], dim, generator=gen),
            "img_projection.0.bias": 0.1 * torch.randn(cfg["hidden_size"], generator=gen),
            "img_projection.2.weight": 0.2 * torch.randn(cfg["hidden_size"], cfg["hidden_size"], generator=gen),
            "img_projection.2.bias": 0.1 * torch.randn(cfg["hidden_size"], generator=gen)}
    lm_state = {k: v.contiguous() for k, v in lm.state_dict().items()}
    vision_state = {f"model.vision_embed_tokens.img_processor.{k}": v.contiguous() for k, v in clip.state_dict().items()}
    vision_state.update({f"model.vision_embed_tokens.{k}": v for k, v in glue.items()})
    # The image embedder keeps the decoder's embedding as `wte`: the real checkpoint may save it twice.
    vision_state["model.vision_embed_tokens.wte.weight"] = lm_state["model.embed_tokens.weight"].clone()
    shards = {"model-00001-of-00002.safetensors": lm_state, "model-00002-of-00002.safetensors": vision_state}
    index = {"metadata": {"total_size": sum(t.numel() * 4 for s in shards.values() for t in s.values())},
             "weight_map": {}}
    for fname, state in shards.items():
        save_file(state, os.path.join(path, fname), metadata={"format": "pt"})
        index["weight_map"].update({k: fname for k in state})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump({"auto_map": {"AutoProcessor": "processing_phi3_v.Phi3VProcessor",
                                "AutoImageProcessor": "image_processing_phi3_v.Phi3VImageProcessor"},
                   "num_crops": num_crops, "image_mean": MEAN, "image_std": STD,
                   "image_processor_type": "Phi3VImageProcessor", "processor_class": "Phi3VProcessor",
                   "num_img_tokens": 4}, f, indent=1)
    tok.save_pretrained(path)
    clip.save_pretrained(os.path.join(path, "reference_clip"))
    lm.save_pretrained(os.path.join(path, "reference_lm"))
    torch.save(glue, os.path.join(path, "reference_glue.pt"))
    with open(os.path.join(path, "reference.json"), "w") as f:
        json.dump({"num_crops": num_crops}, f)
    return path
