"""Tiny NeVA / Video NeVA `.nemo` archives in NeMo's file layout and tensor names, and an independent
reference of the published architecture (transformers' NemotronForCausalLM + CLIPVisionModel + the
mlp2x_gelu projector, frames decoded with PyAV). Imports nothing of splitserve.

The decoder's weights start as a transformers Nemotron model; this file writes them out the way
NeMo stores them (fused query_key_value laid out per query group as [the group's query heads, its
key head, its value head], LayerNorm1P weights as w - 1, `dense_h_to_4h` / `dense_4h_to_h`), so the
engine's loader is checked against transformers through NeMo's layout rather than against itself.
"""
from __future__ import annotations

import io
import os
import shutil
import tarfile

import numpy as np
import torch
import transformers
import yaml

SIDE = 56          # CLIP input side: 4x4 patches of 14 px -> 16 features per image (class token dropped)
TOKENS_PER_IMAGE = 16
HIDDEN, HEADS, GROUPS, FFN, LAYERS = 64, 4, 2, 128, 2
EXTRA_IDS = [f"<extra_id_{i}>" for i in range(8)]
PATCH_TOKEN = "<extra_id_3>"
NVGPT_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives "
                "helpful, detailed, and polite answers to the user's questions.")


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))  # LayerNorm1P: stored w - 1
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))


def make_decoder(vocab: int, seed: int) -> transformers.NemotronForCausalLM:
    config = transformers.NemotronConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=HIDDEN // HEADS, hidden_act="relu2",
        max_position_embeddings=1024, norm_eps=1e-5, attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    model = transformers.NemotronForCausalLM(config).eval()
    _randomize(model, seed)
    return model


def make_clip(seed: int) -> transformers.CLIPVisionModel:
    config = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                           num_attention_heads=4, image_size=SIDE, patch_size=14)
    model = transformers.CLIPVisionModel(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1 + 0.1 * torch.randn(p.shape, generator=gen)) if "norm" in name and name.endswith("weight")
                    else 0.2 * torch.randn(p.shape, generator=gen))
    return model


def make_projector(seed: int) -> torch.nn.Sequential:
    proj = torch.nn.Sequential(torch.nn.Linear(32, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, HIDDEN))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in proj.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return proj


def clip_image_processor():
    cls = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    return cls(size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE})


def write_clip_dir(path: str, clip, whole_clip: bool = False) -> str:
    """The tower's HF directory; whole_clip: as a CLIPModel with a (random) text side too, the way
    openai/clip-vit-large-patch14-336 is published."""
    if whole_clip:
        text = transformers.CLIPTextConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, vocab_size=99, projection_dim=8,
                                           bos_token_id=0, eos_token_id=1, pad_token_id=1)
        config = transformers.CLIPConfig(text_config=text.to_dict(), vision_config=clip.config.to_dict(),
                                         projection_dim=8)
        whole = transformers.CLIPModel(config).eval()
        own = {k if k.startswith("vision_model.") else "vision_model." + k: v for k, v in clip.state_dict().items()}
        result = whole.load_state_dict(own, strict=False)
        assert not result.unexpected_keys and not any(k.startswith("vision_model.") for k in result.missing_keys)
        whole.save_pretrained(path)
    else:
        clip.save_pretrained(path)
    clip_image_processor().save_pretrained(path)
    return path


# -- NeMo's layout ----------------------------------------------------------------------------------
def _group_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HF q/k/v rows -> Megatron's fused rows: for each query group, its query heads, then k, then v."""
    hd = HIDDEN // HEADS
    per = HEADS // GROUPS
    rest = q.shape[1:]
    qg = q.reshape(GROUPS, per, hd, *rest)
    kg = k.reshape(GROUPS, 1, hd, *rest)
    vg = v.reshape(GROUPS, 1, hd, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def nemo_state_dict(decoder, projector, mcore: bool = False) -> dict[str, torch.Tensor]:
    """The decoder + projector under NeMo's names (legacy `language_model.encoder`, or mcore `decoder`).
    LayerNorm1P: transformers' Nemotron stores w - 1, as NeMo's layernorm1p does."""
    sd = {k: v.detach().clone() for k, v in decoder.state_dict().items()}
    out = {}
    lm = "model.language_model."
    out[lm + "embedding.word_embeddings.weight"] = sd["model.embed_tokens.weight"]
    for i in range(LAYERS):
        h = f"model.layers.{i}."
        if mcore:
            n = f"model.decoder.layers.{i}."
            names = {"ln1": n + "self_attention.linear_qkv.layer_norm_", "qkv": n + "self_attention.linear_qkv.",
                     "dense": n + "self_attention.linear_proj.", "ln2": n + "mlp.linear_fc1.layer_norm_",
                     "fc1": n + "mlp.linear_fc1.", "fc2": n + "mlp.linear_fc2."}
        else:
            n = f"{lm}encoder.layers.{i}."
            names = {"ln1": n + "input_layernorm.", "qkv": n + "self_attention.query_key_value.",
                     "dense": n + "self_attention.dense.", "ln2": n + "post_attention_layernorm.",
                     "fc1": n + "mlp.dense_h_to_4h.", "fc2": n + "mlp.dense_4h_to_h."}
        for p in ("weight", "bias"):
            out[names["ln1"] + p] = sd[h + f"input_layernorm.{p}"]
            out[names["ln2"] + p] = sd[h + f"post_attention_layernorm.{p}"]
            out[names["qkv"] + p] = _group_qkv(*(sd[h + f"self_attn.{x}_proj.{p}"] for x in "qkv"))
            out[names["dense"] + p] = sd[h + f"self_attn.o_proj.{p}"]
            out[names["fc1"] + p] = sd[h + f"mlp.up_proj.{p}"]
            out[names["fc2"] + p] = sd[h + f"mlp.down_proj.{p}"]
    final = "model.decoder.final_layernorm." if mcore else lm + "encoder.final_layernorm."
    out[final + "weight"] = sd["model.norm.weight"]
    out[final + "bias"] = sd["model.norm.bias"]
    out[("model.output_layer.weight" if mcore else lm + "output_layer.weight")] = sd["lm_head.weight"]
    adapter = "model.embedding.word_embeddings.adapter_layer.mm_projector_adapter.mm_projector."
    for idx in (0, 2):
        out[f"{adapter}{idx}.weight"] = projector[idx].weight.detach().clone()
        out[f"{adapter}{idx}.bias"] = projector[idx].bias.detach().clone()
    return out


def split_tensor_parallel(sd: dict, tp: int) -> list[dict]:
    """Megatron's tensor-parallel shards: column-parallel rows (whole query groups per rank),
    row-parallel columns, the rest replicated."""
    shards = [{} for _ in range(tp)]
    for name, t in sd.items():
        if any(s in name for s in ("query_key_value", "linear_qkv.weight", "linear_qkv.bias", "dense_h_to_4h",
                                   "linear_fc1.weight", "linear_fc1.bias", "word_embeddings.weight",
                                   "output_layer")) and "adapter" not in name:
            parts = t.chunk(tp, dim=0)
        elif name.endswith("weight") and any(s in name for s in ("self_attention.dense", "dense_4h_to_h",
                                                                  "linear_proj", "linear_fc2")):
            parts = t.chunk(tp, dim=1)
        else:
            parts = [t] * tp
        for shard, part in zip(shards, parts):
            shard[name] = part.clone()
    return shards


def model_config(tower: str, conv: str = "nvgpt", media: str = "image", num_frames: int = 4, mcore: bool = False,
                 tp: int = 1) -> dict:
    return {
        "mcore_gpt": mcore, "tensor_model_parallel_size": tp, "num_layers": LAYERS, "hidden_size": HIDDEN,
        "ffn_hidden_size": FFN, "num_attention_heads": HEADS, "num_query_groups": GROUPS, "kv_channels": None,
        "activation": "squared-relu", "normalization": "layernorm1p", "layernorm_epsilon": 1e-5, "bias": True,
        "position_embedding_type": "rope", "rotary_percentage": 0.5, "rotary_base": 10000,
        "share_embeddings_and_output_weights": False, "max_position_embeddings": 1024, "encoder_seq_length": 1024,
        "make_vocab_size_divisible_by": 128, "transformer_block_type": "pre_ln",
        "tokenizer": {"library": "huggingface", "type": "nemo:tokenizer", "model": None},
        "mm_cfg": {"llm": {"from_pretrained": None, "freeze": True, "model_type": "nvgpt"},
                   "vision_encoder": {"from_pretrained": tower, "from_hf": True, "patch_dim": 14, "hidden_size": 32,
                                      "vision_select_layer": -2, "class_token_length": 1, "freeze": True},
                   "mm_mlp_adapter_type": "mlp2x_gelu", "use_im_start_end": False},
        "data": {"media_type": media, "num_frames": num_frames, "image_token_len": TOKENS_PER_IMAGE,
                 "conv_template": conv, "image_aspect_ratio": "square", "is_multimodal": True},
    }


def write_nemo(path: str, config: dict, state_dict: dict, tokenizer, tp: int = 1, compress: bool = False) -> str:
    """A .nemo: a tar of ./model_config.yaml, ./model_weights.ckpt (or ./mp_rank_NN/model_weights.ckpt)
    and the tokenizer's files."""
    members: dict[str, bytes] = {"./model_config.yaml": yaml.safe_dump(config).encode()}
    shards = [state_dict] if tp == 1 else split_tensor_parallel(state_dict, tp)
    for rank, shard in enumerate(shards):
        buf = io.BytesIO()
        torch.save(shard, buf)
        members["./model_weights.ckpt" if tp == 1 else f"./mp_rank_{rank:02d}/model_weights.ckpt"] = buf.getvalue()
    tok_dir = path + ".tokenizer"
    tokenizer.save_pretrained(tok_dir)
    for name in os.listdir(tok_dir):
        with open(os.path.join(tok_dir, name), "rb") as f:
            members[f"./tokenizer/{name}"] = f.read()
    shutil.rmtree(tok_dir)
    with tarfile.open(path, "w:gz" if compress else "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def expand_to_square(img, mean):
    """NeMo's image_aspect_ratio 'pad': the image centred on a square of the processor's mean colour."""
    from PIL import Image
    w, h = img.size
    if w == h:
        return img
    side = max(w, h)
    out = Image.new(img.mode, (side, side), tuple(int(round(m * 255)) for m in mean))
    out.paste(img, ((side - w) // 2, (side - h) // 2))
    return out


# -- video ------------------------------------------------------------------------------------------
def write_video(path: str, colors: list[tuple[int, int, int]], size=(64, 48), codec="mpeg4", seed: int = 0) -> str:
    """A short clip, one frame per colour plus some noise so frames differ in texture too."""
    import av
    rng = np.random.default_rng(seed)
    with av.open(path, "w") as out:
        stream = out.add_stream(codec, rate=8)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        for c in colors:
            arr = np.clip(np.array(c, dtype=np.int16) + rng.integers(-30, 30, (size[1], size[0], 3)), 0, 255)
            frame = av.VideoFrame.from_ndarray(arr.astype(np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def read_video_frames(path_or_bytes, num_frames: int) -> list:
    """Video NeVA's sampling: every frame decoded, min(num_frames, T) indices spread evenly over
    [0, T - 1] (np.linspace, rounded down), the last one repeated up to num_frames."""
    import av
    from PIL import Image
    src = io.BytesIO(path_or_bytes) if isinstance(path_or_bytes, bytes) else path_or_bytes
    with av.open(src) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    n = min(num_frames, len(frames))
    idx = list(np.linspace(0, len(frames) - 1, num=n, dtype=int))
    idx += [idx[-1]] * (num_frames - n)
    return [Image.fromarray(frames[i], "RGB") for i in idx]


# -- the reference model ----------------------------------------------------------------------------
class ReferenceNeva:
    def __init__(self, decoder, clip, projector, tokenizer):
        self.decoder, self.clip, self.projector, self.tok = decoder, clip, projector, tokenizer
        self.processor = clip_image_processor()
        self.placeholder = tokenizer.convert_tokens_to_ids(PATCH_TOKEN)

    @torch.inference_mode()
    def features(self, images: list) -> torch.Tensor:
        """[frames * 16, hidden]: CLIP's second-to-last hidden state without the class token, projected."""
        pixels = self.processor(images=images, return_tensors="pt")["pixel_values"]
        hidden = self.clip(pixel_values=pixels, output_hidden_states=True).hidden_states[-2][:, 1:]
        return self.projector(hidden).reshape(-1, HIDDEN)

    def prompt(self, segments: list) -> tuple[list[int], torch.Tensor]:
        """segments: text (tokenized without special tokens), ("image", PIL) or ("video", [frames])."""
        ids, embeds = [], []
        emb = self.decoder.get_input_embeddings()
        for seg in segments:
            if isinstance(seg, str):
                piece = self.tok.encode(seg, add_special_tokens=False)
                ids += piece
                embeds.append(emb(torch.tensor(piece, dtype=torch.long)))
            else:
                kind, media = seg
                feats = self.features([media] if kind == "image" else media)
                ids += [self.placeholder] * feats.shape[0]
                embeds.append(feats)
        return ids, torch.cat(embeds)

    @torch.inference_mode()
    def greedy(self, segments: list, n: int) -> tuple[list[int], list[float], list[int]]:
        ids, x = self.prompt(segments)
        emb = self.decoder.get_input_embeddings()
        tokens, logprobs = [], []
        for _ in range(n):
            logits = self.decoder(inputs_embeds=x[None], logits_to_keep=1).logits[0, -1].float()
            t = int(logits.argmax())
            tokens.append(t)
            logprobs.append(torch.log_softmax(logits, -1)[t].item())
            x = torch.cat([x, emb(torch.tensor([t]))])
        return tokens, logprobs, ids
