"""CogVLM (`CogVLMForCausalLM`, THUDM/cogvlm-chat-hf; remote code in the real world). Config reader:
config.py; image transform, prompt layout and token count: processor.py.

Vision: EVA2-CLIP-E (conv patches + class token + learned positions; layers whose attention and MLP
outputs are LayerNorm-ed before the residual add), the class token dropped, a GLU projector
(linear, LayerNorm, GELU, SiLU-gated MLP) into the decoder's width, and learned `boi` / `eoi`
vectors around the patches: (S/p)^2 + 2 tokens per image.

Language: Llama whose every layer has a *visual expert*: its own QKV (with bias), output dense and
MLP weights for image tokens, routed as a mixture of two experts by token type. Before a step with
image tokens the multimodal step encoder calls `prepare_step_tokens`, which sets the step's route
(image rows, text rows, RoPE shifts; data, never a loop over requests); each layer gathers the image
rows through the visual expert and the rest through the language weights and scatters them back. A
step without a route (every decode step, text-only prompts) runs plain Llama layers: the visual
expert costs it nothing, and its compiled halves and CUDA graphs are Llama's.

Positions: the published model gives the whole image 3 positions (boi p, every patch p + 1, eoi
p + 2), and text after it continues from there. The engine's positions are token indices (they also
address the KV cache), so the rotary angle of the tokens up to the image's end is shifted instead:
token i is rotated at published_position(i) + D (D = image tokens - 3), a pre-rotation by the
shift before the attention op rotates at i. Attention only sees position differences, so this is
the published model exactly, and every token after the image needs no shift (decode steps are plain
steps). It also needs every request with an image to have it in the same place: the published
prompt puts the one image right after BOS (`build_conversation_input_ids`), and so does this one.
"""
from __future__ import annotations

from typing import Iterable, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from splitserve.parallel.parallel_state import pp_group, tp_group
from splitserve.layers.linear import Linear
from splitserve.layers.quantization.base import as_tensor, copy_checkpoint_tensor
from splitserve.layers.rotary import apply_rotary_qk
from splitserve.models.decoder import DecoderLayer
from splitserve.models.cogvlm.processor import CogVLMProcessing
from splitserve.models.vlm_base import VisionLanguageModel, build_language_model
from splitserve.multimodal.processor import to_device_pixels


# -- EVA2-CLIP --------------------------------------------------------------------------------------
class EvaLayer(nn.Module):
    def __init__(self, dim: int, heads: int, inter: int, eps: float):
        super().__init__()
        self.heads = heads
        self.input_layernorm = nn.LayerNorm(dim, eps=eps)
        self.post_attention_layernorm = nn.LayerNorm(dim, eps=eps)
        self.attention = nn.Module()
        self.attention.query_key_value = Linear(dim, 3 * dim, bias=True)
        self.attention.dense = Linear(dim, dim, bias=True)
        self.mlp = nn.Module()
        self.mlp.fc1 = Linear(dim, inter, bias=True)
        self.mlp.fc2 = Linear(inter, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, D = x.shape
        q, k, v = self.attention.query_key_value(x).view(B, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, L, D)
        x = x + self.input_layernorm(self.attention.dense(attn))  # sub-layer norm on the output
        return x + self.post_attention_layernorm(self.mlp.fc2(F.gelu(self.mlp.fc1(x))))


class EvaVision(nn.Module):
    """`model.vision.*`: EVA2-CLIP + GLU projector + boi/eoi; [N, 3, S, S] -> [N, patches + 2, hidden]."""

    def __init__(self, vc: dict, hidden: int, inter: int):
        super().__init__()
        dim = vc["hidden_size"]
        self.patch_embedding = nn.Module()
        self.patch_embedding.proj = nn.Conv2d(vc.get("in_channels", 3), dim, vc["patch_size"], vc["patch_size"])
        self.patch_embedding.cls_embedding = nn.Parameter(torch.empty(1, dim), requires_grad=False)
        self.patch_embedding.position_embedding = nn.Embedding(vc["num_positions"], dim)
        self.transformer = nn.Module()
        self.transformer.layers = nn.ModuleList(
            EvaLayer(dim, vc["num_heads"], vc["intermediate_size"], vc.get("layer_norm_eps", 1e-6))
            for _ in range(vc["num_hidden_layers"]))
        self.linear_proj = nn.Module()
        glu = self.linear_proj
        glu.linear_proj = Linear(dim, hidden)
        glu.norm1 = nn.LayerNorm(hidden)
        glu.gate_proj, glu.dense_h_to_4h = Linear(hidden, inter), Linear(hidden, inter)
        glu.dense_4h_to_h = Linear(inter, hidden)
        self.boi = nn.Parameter(torch.empty(1, 1, hidden), requires_grad=False)
        self.eoi = nn.Parameter(torch.empty(1, 1, hidden), requires_grad=False)
        self.requires_grad_(False)
        if vc.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"CogVLM vision hidden_act {vc['hidden_act']!r} is not supported (gelu is)")
        if (vc["image_size"] // vc["patch_size"]) ** 2 + 1 != vc["num_positions"]:
            raise ValueError("CogVLM vision_config: num_positions must be (image_size / patch_size)^2 + 1")

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        pe = self.patch_embedding
        x = pe.proj(pixels).flatten(2).transpose(1, 2)
        x = torch.cat([pe.cls_embedding.expand(x.shape[0], 1, -1), x], dim=1) + pe.position_embedding.weight
        for layer in self.transformer.layers:
            x = layer(x)
        glu = self.linear_proj
        x = F.gelu(glu.norm1(glu.linear_proj(x[:, 1:])))
        x = glu.dense_4h_to_h(F.silu(glu.gate_proj(x)) * glu.dense_h_to_4h(x))
        n = x.shape[0]
        return torch.cat([self.boi.expand(n, 1, -1).to(x.dtype), x, self.eoi.expand(n, 1, -1).to(x.dtype)], dim=1)


# -- the language side --------------------------------------------------------------------------------
class StepRoute(NamedTuple):
    """A step with image-expert work, as device index tensors: the flat rows that take the visual
    expert, the rows that take the language weights, and every row's RoPE pre-rotation."""
    vision_rows: torch.Tensor
    text_rows: torch.Tensor
    shift: torch.Tensor


class ExpertTokens:
    """The step's route, shared by every layer: None for a step without image-expert work (decode
    steps, text-only prompts), which then runs plain Llama layers. The step encoder sets it before a
    step with image tokens (`prepare_step_tokens`) and the model's forward clears it after."""

    def __init__(self):
        self.route: StepRoute | None = None


class VisionExpertLayer(DecoderLayer):
    """A Llama layer plus the visual expert's weights, as a mixture of two experts routed by token
    type. `attn_inputs` / `attn_outputs` are the inherited Llama halves (compiled, and captured in
    CUDA graphs): a step without image rows runs only them, at plain Llama's shapes and cost. A step
    with a route gathers the image rows through the visual expert and the other rows through the
    language weights, scattering both back (eager: its row counts change every step, so it never
    replays a graph; the runner keeps such steps off the piecewise path, `image_steps_eager`)."""

    def __init__(self, spec, layer_idx: int, rotary, prefix: str, tokens: ExpertTokens):
        super().__init__(spec, layer_idx, rotary, None, prefix, layer_idx)
        H, I = spec.hidden_size, spec.intermediate_size
        self.vision_qkv = Linear(H, 3 * H, bias=True)
        self.vision_dense = Linear(H, H, bias=False)
        self.vision_mlp = nn.ModuleDict({"gate_proj": Linear(H, I), "up_proj": Linear(H, I), "down_proj": Linear(I, H)})
        object.__setattr__(self, "_tokens", tokens)  # shared by every layer, owned by the model
        self.rotary = rotary
        self.heads, self.head_dim = spec.num_heads, spec.head_dim

    def forward(self, positions, x, residual):
        route = self._tokens.route
        if route is None:
            return super().forward(positions, x, residual)
        q, k, v, residual = self.routed_inputs(x, residual, route)
        return self.routed_outputs(self.self_attn.attn(q, k, v, positions), residual, route)

    @staticmethod
    def _two_experts(x, route: StepRoute, text_fn, vision_fn, width: int) -> torch.Tensor:
        out = x.new_empty(x.shape[0], width)
        out.index_copy_(0, route.text_rows, text_fn(x.index_select(0, route.text_rows)))
        out.index_copy_(0, route.vision_rows, vision_fn(x.index_select(0, route.vision_rows)))
        return out

    def routed_inputs(self, x, residual, route: StepRoute):
        x, residual = self.input_layernorm(x, residual)
        T = x.shape[0]
        qkv = self._two_experts(x, route, self.self_attn.qkv_proj, self.vision_qkv, self.vision_qkv.weight.shape[0])
        q, k, v = self.self_attn.qkv_proj.split(qkv)
        q, k = apply_rotary_qk(q.view(T, self.heads, self.head_dim), k.view(T, self.heads, self.head_dim),
                               route.shift, self.rotary.cos_sin)
        return q.reshape(T, -1), k.reshape(T, -1), v, residual

    def _vision_mlp(self, x):
        m = self.vision_mlp
        return m["down_proj"](F.silu(m["gate_proj"](x)) * m["up_proj"](x))

    def routed_outputs(self, attn_out, residual, route: StepRoute):
        H = residual.shape[1]
        x = self._two_experts(attn_out, route, self.self_attn.o_proj, self.vision_dense, H)
        x, residual = self.post_attention_layernorm(x, residual)
        return self._two_experts(x, route, self.mlp, self._vision_mlp, H), residual


class CogVLMForCausalLM(CogVLMProcessing, VisionLanguageModel):
    image_steps_eager = True  # routed steps change shapes with their image rows (VisionExpertLayer)

    def __init__(self, config, quant_config=None):
        super().__init__()
        if quant_config is not None:
            raise ValueError("CogVLM: quantized checkpoints are not supported")
        if tp_group().world_size > 1 or pp_group().world_size > 1:
            raise ValueError("CogVLM: tensor / pipeline parallelism is not supported for the visual expert yet")
        self.config = config
        self.language_model = lm = build_language_model(config, None, "model", "lm_head")
        self.expert_tokens = ExpertTokens()
        rotary = lm.layers[0].self_attn.attn.rotary
        n = len(lm.layers)
        lm.layers = nn.ModuleList(VisionExpertLayer(lm.spec, i, rotary, f"model.layers.{i}.", self.expert_tokens)
                                  for i in range(n))
        vc = config.vision_config
        self.vision = EvaVision(vc, config.hidden_size, config.intermediate_size)
        self.init_processing(config)  # side, tokens_per_image, image token (processor.py)

    # -- images ------------------------------------------------------------------------------------
    def encode_images(self, items) -> list[torch.Tensor]:
        feats = self.vision(to_device_pixels(items, self._param.device, self._param.dtype))
        return list(feats.unbind(0))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None,
                intermediate=None):
        if inputs_embeds is None:  # routed steps come with the step encoder's embeddings: a stale route
            self.expert_tokens.route = None  # (a step that failed before its forward) never leaks here
        try:
            return self.language_model(input_ids, positions, inputs_embeds, intermediate)
        finally:  # the route belongs to this step alone
            self.expert_tokens.route = None

    def prepare_step_tokens(self, spans, total: int) -> bool:
        """Routes a step's tokens (spans: (request state, first token, count, first flat row) of the
        requests computing tokens up to their image's end): which rows take the visual expert, and
        every row's RoPE shift. False (and no route) when no row needs either: the step is a plain
        Llama step."""
        vision = np.zeros(total, dtype=bool)
        shift = np.zeros(total, dtype=np.int64)
        for state, start, n, row in spans:
            if not state.mm_items:
                continue
            item = state.mm_items[0]
            o, N = item.offset, item.num_tokens
            d = N - 3
            i = np.arange(start, start + n)
            vision[row:row + n] = (i >= o) & (i < o + N - 1)  # the eoi token takes the language weights
            # published positions + D: up to the first patch i + D, patches o + 1 + D, from eoi on i
            shift[row:row + n] = np.where(i <= o + 1, d, np.where(i < o + N - 1, o + 1 + d - i, 0))
        if not vision.any() and not shift.any():
            self.expert_tokens.route = None
            return False
        dev = self._param.device

        def to_dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(dev, non_blocking=True)
        self.expert_tokens.route = StepRoute(to_dev(np.flatnonzero(vision)), to_dev(np.flatnonzero(~vision)),
                                             to_dev(shift))
        return True

    # -- weights -----------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        vision = dict(self.vision.named_parameters())
        layers = self.language_model.layers
        H = self.config.hidden_size

        def copy(param: torch.Tensor, tensor: torch.Tensor, name: str, target: str) -> None:
            copy_checkpoint_tensor(param, tensor, name)
            loaded.add(target)

        def text_weights():
            for name, tensor in weights:
                if name.startswith("model.vision."):
                    rest = name[len("model.vision."):]
                    if rest not in vision:
                        raise ValueError(f"checkpoint tensor {name!r} matches no parameter of the vision model")
                    copy(vision[rest], tensor, name, f"vision.{rest}")
                    continue
                if not name.startswith("model.layers."):
                    yield name, tensor
                    continue
                _, _, index, rest = name.split(".", 3)
                layer = layers[int(index)]
                base = f"model.layers.{index}."
                if rest.endswith("rotary_emb.inv_freq"):
                    continue  # a buffer: the table is the engine's own
                if rest.startswith("self_attn.language_expert_query_key_value."):
                    q, k, v = as_tensor(tensor).split(H, dim=0)
                    param = rest.rsplit(".", 1)[1]
                    yield from ((f"{base}self_attn.{p}_proj.{param}", t) for p, t in zip("qkv", (q, k, v)))
                elif rest.startswith("self_attn.language_expert_dense."):
                    yield f"{base}self_attn.o_proj.{rest.rsplit('.', 1)[1]}", tensor
                elif rest.startswith("mlp.language_mlp."):
                    yield f"{base}mlp.{rest[len('mlp.language_mlp.'):]}", tensor
                elif rest.startswith("self_attn.vision_expert_query_key_value."):
                    param = rest.rsplit(".", 1)[1]
                    copy(getattr(layer.vision_qkv, param), tensor, name, f"layers.{index}.vision_qkv.{param}")
                elif rest.startswith("self_attn.vision_expert_dense."):
                    copy(layer.vision_dense.weight, tensor, name, f"layers.{index}.vision_dense.weight")
                elif rest.startswith("mlp.vision_mlp."):
                    module, param = rest[len("mlp.vision_mlp."):].split(".")
                    if module not in layer.vision_mlp:
                        raise ValueError(f"checkpoint tensor {name!r} matches no parameter")
                    copy(getattr(layer.vision_mlp[module], param), tensor, name,
                         f"layers.{index}.vision_mlp.{module}.{param}")
                else:
                    yield name, tensor

        text_loaded = self.language_model.load_weights(text_weights())
        loaded |= {f"language_model.{n}" for n in text_loaded}
        return {n if not n.startswith("layers.") else f"language_model.{n}" for n in loaded}
