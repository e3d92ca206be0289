"""An independent plain-torch reference of CogVLM (the published `CogVLMForCausalLM` remote code:
modeling_cogvlm.py + visual.py of THUDM/cogvlm-chat-hf), and tiny checkpoints with its real tensor
names. Nothing here imports splitserve.

Re-written from the published definition: EVA2-CLIP (sub-layer-normed attention / MLP outputs),
the GLU projector, boi/eoi; the Llama decoder with the visual expert chosen per token by
`get_expert_mask` (a token of type VISION whose next token is VISION too), `build_position_ids`
(boi, the patches and eoi take 3 positions), `build_conversation_input_ids` ([BOS] + image + text);
greedy decoding as generate() runs it (new tokens LANGUAGE, positions + 1). The language path is
checked against transformers' LlamaForCausalLM by the tests.
"""
from __future__ import annotations

import glob
import json
import os

import numpy as np
import torch
import torch.nn.functional as F

LANGUAGE, VISION = 0, 1
MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)


def tiny_cogvlm_config(tok, image_size: int = 56) -> dict:
    return {"architectures": ["CogVLMForCausalLM"],
            "auto_map": {"AutoConfig": "configuration_cogvlm.CogVLMConfig",
                         "AutoModelForCausalLM": "modeling_cogvlm.CogVLMForCausalLM"},
            "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": 0,
            "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128,
            "max_position_embeddings": 2048, "num_attention_heads": 4, "num_hidden_layers": 2,
            "rms_norm_eps": 1e-5, "template_version": "chat", "tie_word_embeddings": False,
            "torch_dtype": "float32", "vocab_size": len(tok),
            "vision_config": {"dropout_prob": 0.0, "hidden_act": "gelu", "hidden_size": 32, "image_size": image_size,
                              "in_channels": 3, "intermediate_size": 64, "layer_norm_eps": 1e-6, "num_heads": 4,
                              "num_hidden_layers": 2, "num_positions": (image_size // 14) ** 2 + 1, "patch_size": 14}}


def tiny_cogvlm_state(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random tensors under the real checkpoint's names."""
    gen = torch.Generator().manual_seed(seed)
    vc, H, I, V = cfg["vision_config"], cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d, vi, p = vc["hidden_size"], vc["intermediate_size"], vc["patch_size"]

    def r(*shape, scale=0.2):
        return scale * torch.randn(*shape, generator=gen)

    def norm(n):
        return 1 + 0.1 * torch.randn(n, generator=gen)
    s = {"model.embed_tokens.weight": r(V, H), "model.norm.weight": norm(H), "lm_head.weight": r(V, H)}
    for i in range(cfg["num_hidden_layers"]):
        b = f"model.layers.{i}."
        s.update({b + "input_layernorm.weight": norm(H), b + "post_attention_layernorm.weight": norm(H),
                  b + "self_attn.language_expert_query_key_value.weight": r(3 * H, H),
                  b + "self_attn.vision_expert_query_key_value.weight": r(3 * H, H),
                  b + "self_attn.vision_expert_query_key_value.bias": r(3 * H, scale=0.1),
                  b + "self_attn.language_expert_dense.weight": r(H, H),
                  b + "self_attn.vision_expert_dense.weight": r(H, H),
                  b + "self_attn.rotary_emb.inv_freq": 1.0 / 10000 ** (torch.arange(0, H // cfg["num_attention_heads"], 2).float() / (H // cfg["num_attention_heads"]))})
        for e in ("language_mlp", "vision_mlp"):
            s.update({f"{b}mlp.{e}.gate_proj.weight": r(I, H), f"{b}mlp.{e}.up_proj.weight": r(I, H),
                      f"{b}mlp.{e}.down_proj.weight": r(H, I)})
    v = "model.vision."
    s.update({v + "patch_embedding.proj.weight": r(d, 3, p, p), v + "patch_embedding.proj.bias": r(d, scale=0.1),
              v + "patch_embedding.cls_embedding": r(1, d), v + "patch_embedding.position_embedding.weight":
              r(vc["num_positions"], d), v + "boi": r(1, 1, H), v + "eoi": r(1, 1, H),
              v + "linear_proj.linear_proj.weight": r(H, d), v + "linear_proj.norm1.weight": norm(H),
              v + "linear_proj.norm1.bias": r(H, scale=0.1), v + "linear_proj.dense_h_to_4h.weight": r(I, H),
              v + "linear_proj.gate_proj.weight": r(I, H), v + "linear_proj.dense_4h_to_h.weight": r(H, I)})
    for i in range(vc["num_hidden_layers"]):
        b = f"{v}transformer.layers.{i}."
        s.update({b + "input_layernorm.weight": norm(d), b + "input_layernorm.bias": r(d, scale=0.1),
                  b + "post_attention_layernorm.weight": norm(d), b + "post_attention_layernorm.bias": r(d, scale=0.1),
                  b + "attention.query_key_value.weight": r(3 * d, d), b + "attention.query_key_value.bias": r(3 * d, scale=0.1),
                  b + "attention.dense.weight": r(d, d), b + "attention.dense.bias": r(d, scale=0.1),
                  b + "mlp.fc1.weight": r(vi, d), b + "mlp.fc1.bias": r(vi, scale=0.1),
                  b + "mlp.fc2.weight": r(d, vi), b + "mlp.fc2.bias": r(d, scale=0.1)})
    return s


def make_tiny_cogvlm_dir(path, tok, seed: int = 0, image_size: int = 56) -> str:
    """cogvlm-chat-hf's layout: config.json (vision_config inside), sharded safetensors + index,
    the tokenizer (no image processor file: the published code builds its transform itself)."""
    from safetensors.torch import save_file
    path = str(path)
    os.makedirs(path, exist_ok=True)
    cfg = tiny_cogvlm_config(tok, image_size)
    state = tiny_cogvlm_state(cfg, seed)
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": [n for n in names if not n.startswith("model.vision.")],
              "model-00002-of-00002.safetensors": [n for n in names if n.startswith("model.vision.")]}
    index = {"metadata": {"total_size": sum(t.numel() * 4 for t in state.values())}, "weight_map": {}}
    for fname, keys in shards.items():
        save_file({k: state[k].contiguous() for k in keys}, os.path.join(path, fname), metadata={"format": "pt"})
        index["weight_map"].update({k: fname for k in keys})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    tok.save_pretrained(path)
    return path


# -- the published functions -----------------------------------------------------------------------------
def get_expert_mask(token_type_ids):
    vision_token_mask = torch.zeros_like(token_type_ids, dtype=torch.bool)
    vision_token_mask[:, :-1] = (token_type_ids[:, :-1] == VISION) & (token_type_ids[:, 1:] == VISION)
    return vision_token_mask, ~vision_token_mask


def build_position_ids(x):
    tmp = x.clone()
    is_boi_eoi = torch.zeros_like(x, dtype=torch.bool)
    is_boi_eoi[:, 1:] |= (tmp[:, 1:] == VISION) & (tmp[:, :-1] == LANGUAGE)
    is_boi_eoi[:, 0] |= (tmp[:, 0] == VISION)
    is_boi_eoi[:, :-1] |= (tmp[:, :-1] == VISION) & (tmp[:, 1:] == LANGUAGE)
    is_boi_eoi[:, -1] |= (tmp[:, -1] == VISION)
    tmp[is_boi_eoi] = LANGUAGE
    y = torch.zeros_like(x, dtype=torch.long)
    y[:, 1:] = (tmp[:, 1:] == LANGUAGE) | ((tmp[:, 1:] == VISION) & (tmp[:, :-1] == LANGUAGE))
    return y.cumsum(dim=-1)


def reference_pixels(img, size: int) -> torch.Tensor:
    from PIL import Image
    x = torch.tensor(np.array(img.convert("RGB").resize((size, size), Image.BICUBIC)), dtype=torch.float32)
    x = x.permute(2, 0, 1) / 255.0
    return (x - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)


class ReferenceCogVLM:
    def __init__(self, path: str):
        from safetensors.torch import load_file
        with open(os.path.join(path, "config.json")) as f:
            self.cfg = json.load(f)
        self.w = {}
        for file in glob.glob(os.path.join(path, "*.safetensors")):
            self.w.update(load_file(file))

    # visual.py
    @torch.inference_mode()
    def vision(self, images: torch.Tensor) -> torch.Tensor:
        vc, w, v = self.cfg["vision_config"], self.w, "model.vision."
        x = F.conv2d(images, w[v + "patch_embedding.proj.weight"], w[v + "patch_embedding.proj.bias"],
                     stride=vc["patch_size"]).flatten(2).transpose(1, 2)
        x = torch.cat([w[v + "patch_embedding.cls_embedding"].expand(x.shape[0], -1, -1), x], dim=1)
        x = x + w[v + "patch_embedding.position_embedding.weight"].unsqueeze(0)
        heads, dim, eps = vc["num_heads"], vc["hidden_size"], vc["layer_norm_eps"]
        for i in range(vc["num_hidden_layers"]):
            b = f"{v}transformer.layers.{i}."
            B, L, _ = x.shape
            qkv = F.linear(x, w[b + "attention.query_key_value.weight"], w[b + "attention.query_key_value.bias"])
            q, k, vv = qkv.reshape(B, L, 3, heads, -1).permute(2, 0, 3, 1, 4)
            att = torch.softmax(q @ k.transpose(-1, -2) * (dim // heads) ** -0.5, dim=-1) @ vv
            out = F.linear(att.transpose(1, 2).reshape(B, L, -1), w[b + "attention.dense.weight"], w[b + "attention.dense.bias"])
            x = x + F.layer_norm(out, (dim,), w[b + "input_layernorm.weight"], w[b + "input_layernorm.bias"], eps)
            h = F.linear(F.gelu(F.linear(x, w[b + "mlp.fc1.weight"], w[b + "mlp.fc1.bias"])),
                         w[b + "mlp.fc2.weight"], w[b + "mlp.fc2.bias"])
            x = x + F.layer_norm(h, (dim,), w[b + "post_attention_layernorm.weight"],
                                 w[b + "post_attention_layernorm.bias"], eps)
        x = x[:, 1:]
        g = v + "linear_proj."
        x = F.linear(x, w[g + "linear_proj.weight"])
        x = F.gelu(F.layer_norm(x, (x.shape[-1],), w[g + "norm1.weight"], w[g + "norm1.bias"]))
        x = F.linear(F.silu(F.linear(x, w[g + "gate_proj.weight"])) * F.linear(x, w[g + "dense_h_to_4h.weight"]),
                     w[g + "dense_4h_to_h.weight"])
        n = x.shape[0]
        return torch.cat([w[v + "boi"].expand(n, -1, -1), x, w[v + "eoi"].expand(n, -1, -1)], dim=1)

    # modeling_cogvlm.py, one sequence, no KV cache
    @torch.inference_mode()
    def logits(self, embeds: torch.Tensor, token_type_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        H, nh, eps = cfg["hidden_size"], cfg["num_attention_heads"], cfg["rms_norm_eps"]
        hd = H // nh
        vis, lang = get_expert_mask(token_type_ids[None])
        vis, lang = vis[0], lang[0]
        L = embeds.shape[0]
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        ang = position_ids.float()[:, None] * inv[None]
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

        def rope(t):  # [nh, L, hd]
            t1, t2 = t[..., :hd // 2], t[..., hd // 2:]
            return t * cos + torch.cat([-t2, t1], -1) * sin

        def rms(x, weight):
            return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

        def expert(x, name_v, name_l, bias_v=None):
            out = torch.empty(x.shape[0], w[name_v].shape[0])
            out[vis] = F.linear(x[vis], w[name_v], bias_v)
            out[lang] = F.linear(x[lang], w[name_l])
            return out
        x = embeds
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        for i in range(cfg["num_hidden_layers"]):
            b = f"model.layers.{i}."
            h = rms(x, w[b + "input_layernorm.weight"])
            qkv = expert(h, b + "self_attn.vision_expert_query_key_value.weight",
                         b + "self_attn.language_expert_query_key_value.weight",
                         w[b + "self_attn.vision_expert_query_key_value.bias"])
            q, k, v = (t.view(L, nh, hd).transpose(0, 1) for t in qkv.split(H, dim=-1))
            q, k = rope(q), rope(k)
            s = (q @ k.transpose(-1, -2)) / hd ** 0.5
            att = torch.softmax(s.masked_fill(~causal, float("-inf")), -1) @ v
            ctx = att.transpose(0, 1).reshape(L, H)
            x = x + expert(ctx, b + "self_attn.vision_expert_dense.weight", b + "self_attn.language_expert_dense.weight")
            h = rms(x, w[b + "post_attention_layernorm.weight"])
            out = torch.empty_like(h)
            for mask, e in ((vis, "vision_mlp"), (lang, "language_mlp")):
                m = f"{b}mlp.{e}."
                hm = h[mask]
                out[mask] = F.linear(F.silu(F.linear(hm, w[m + "gate_proj.weight"])) * F.linear(hm, w[m + "up_proj.weight"]),
                                     w[m + "down_proj.weight"])
            x = x + out
        return F.linear(rms(x, w["model.norm.weight"]), w["lm_head.weight"])

    def input_ids(self, tok, text: str, with_image: bool) -> tuple[list[int], list[int]]:
        """build_conversation_input_ids with the query text given whole (no template applied)."""
        vc = self.cfg["vision_config"]
        n = (vc["image_size"] // vc["patch_size"]) ** 2 + 2 if with_image else 0
        text_ids = tok.encode(text, add_special_tokens=False)
        ids = [tok.bos_token_id] + [self.cfg["pad_token_id"]] * n + text_ids
        types = [LANGUAGE] + [VISION] * n + [LANGUAGE] * len(text_ids)
        return ids, types

    @torch.inference_mode()
    def greedy(self, tok, text: str, image, max_new_tokens: int) -> tuple[list[int], list[float], list[int]]:
        ids, types = self.input_ids(tok, text, image is not None)
        embed = self.w["model.embed_tokens.weight"]
        embeds = embed[torch.tensor(ids)]
        types_t = torch.tensor(types)
        if image is not None:
            size = self.cfg["vision_config"]["image_size"]
            embeds[types_t == VISION] = self.vision(reference_pixels(image, size)[None])[0]
        positions = build_position_ids(types_t[None])[0]
        tokens, logprobs = [], []
        for _ in range(max_new_tokens):
            lp = torch.log_softmax(self.logits(embeds, types_t, positions)[-1], -1)
            t = int(lp.argmax())
            tokens.append(t)
            logprobs.append(lp[t].item())
            embeds = torch.cat([embeds, embed[t][None]])
            types_t = torch.cat([types_t, torch.tensor([LANGUAGE])])
            positions = torch.cat([positions, positions[-1:] + 1])
        return tokens, logprobs, ids
