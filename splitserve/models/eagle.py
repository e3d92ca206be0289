"""EAGLE and EAGLE-3 draft heads, read from the layouts the public checkpoints ship in.

A head is one Llama decoder layer that drafts from the *target's* hidden states instead of from
tokens alone. At position p it takes the embedding of token p + 1 and a feature of position p, and
its output at p is the feature from which token p + 2 is predicted; the next draft step feeds that
output back as the feature of position p + 1.

- EAGLE (e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B): `fc` [H, 2H] (+ bias) over concat(embedding,
  feature), where the feature is the target's final (normed) hidden state; `layers.0.*` a Llama layer
  whose input norm is absent (identity); no final norm; the logits are the *target's* LM head over
  the layer's output (hidden + residual). `embed_tokens` and `lm_head` (a copy of the target's, as
  vLLM's conversion adds it) are optional.
- EAGLE-3 (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): `fc` [H, nH] (n = 3) maps the concat of the
  streams entering n target layers (default 2, L // 2, L - 3 of L layers, as the EAGLE-3 authors
  train them; config key `eagle_aux_hidden_state_layer_ids` overrides) to H, once, for the target's
  features only (the head's own outputs are already H wide). `midlayer.*` (or `layers.0.*`): attention
  over concat(input_layernorm(embedding), hidden_norm(feature)) (q/k/v_proj take 2H), the residual
  being the un-normed feature (`norm_before_residual`: the normed one); `norm` gives the logits'
  input and the output fed back is the pre-norm stream; `lm_head` [draft_vocab, H] over a draft
  vocabulary whose id d is target id d + d2t[d] (`d2t`; `t2d` is the inverse mask, unused).
  Missing `lm_head` / `embed_tokens`: the target's (then the draft vocabulary is the target's).

`inspect_head` reads only config.json and the tensors' names and shapes (start-up validation: an
unknown layout is a ValueError naming what does not fit); `build_head` builds and loads the module.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass

import torch
from torch import nn

from splitserve.layers.cpu_gemm import linear
from splitserve.layers.linear import Linear
from splitserve.layers.norm import RMSNorm
from splitserve.layers.parallel_linear import QKVParallelLinear, VocabParallelEmbedding
from splitserve.layers.rotary import RotaryEmbedding
from splitserve.models.decoder import DecoderForCausalLM, DecoderLayer
from splitserve.models.families import decoder_spec

# Architecture names the public heads' config.json carry (EAGLE-1 heads mostly say LlamaForCausalLM).
EAGLE_ARCHS = ("LlamaForCausalLM", "LlamaForCausalLMEagle", "EagleLlamaForCausalLM")
EAGLE3_ARCHS = ("LlamaForCausalLM", "LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
_LAYER_TENSORS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                  "post_attention_layernorm.weight")
_OPTIONAL_LAYER = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")


def _weight_files(directory: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    return files or sorted(glob.glob(os.path.join(directory, "pytorch_model*.bin")))


def _tensor_shapes(files: list[str]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor (safetensors headers, or a memory-mapped .bin: nothing read)."""
    shapes = {}
    for path in files:
        if path.endswith(".safetensors"):
            from safetensors import safe_open
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    shapes[_name(name)] = tuple(f.get_slice(name).get_shape())
        else:
            for name, t in torch.load(path, map_location="cpu", weights_only=True, mmap=True).items():
                shapes[_name(name)] = tuple(t.shape)
    return shapes


def _tensors(files: list[str]):
    for path in files:
        if path.endswith(".safetensors"):
            from safetensors.torch import safe_open
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield _name(name), f.get_tensor(name)
        else:
            for name, t in torch.load(path, map_location="cpu", weights_only=True, mmap=True).items():
                yield _name(name), t


def _name(name: str) -> str:
    """Some conversions nest the head under `model.`: the public names are the ones without."""
    return name[len("model."):] if name.startswith("model.") else name


@dataclass(frozen=True)
class HeadInfo:
    """What start-up learned about a head directory (config.json + tensor shapes)."""
    method: str                   # "eagle" or "eagle3"
    directory: str
    files: tuple[str, ...]
    config: object                # transformers.LlamaConfig of the head's layer
    layer_prefix: str             # "layers.0." or "midlayer."
    aux_layers: tuple[int, ...]   # EAGLE-3: the target layers whose input streams feed fc
    draft_vocab_size: int
    has_embed: bool
    has_lm_head: bool
    fc_bias: bool
    input_norm: bool              # EAGLE: layer 0 has an input_layernorm (the public heads do not)
    has_d2t: bool
    norm_before_residual: bool


def inspect_head(directory: str, method: str, target_config) -> HeadInfo:
    """Validates a head directory against the target's config; ValueError naming the mismatch."""
    from transformers import LlamaConfig
    where = f"speculative_config: {method} head {directory}"
    cfg_path = os.path.join(directory, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"{where}: no config.json (expected an EAGLE head checkpoint directory)")
    with open(cfg_path) as f:
        raw = json.load(f)
    archs = raw.get("architectures") or ["LlamaForCausalLM"]
    known = EAGLE_ARCHS if method == "eagle" else EAGLE3_ARCHS
    if archs[0] not in known or raw.get("model_type", "llama") != "llama":
        raise ValueError(f"{where}: architecture {archs[0]!r} / model_type {raw.get('model_type')!r} is not a known "
                         f"{method} head layout (expected model_type llama and one of {', '.join(known)})")
    files = _weight_files(directory)
    if not files:
        raise ValueError(f"{where}: no *.safetensors or pytorch_model*.bin weights")
    shapes = _tensor_shapes(files)
    H = target_config.hidden_size
    if raw.get("hidden_size") != H:
        raise ValueError(f"{where}: hidden_size {raw.get('hidden_size')} differs from the target's {H}")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {raw.get('hidden_act')!r} (only silu heads are supported)")
    fc = shapes.get("fc.weight")
    if fc is None or len(fc) != 2 or fc[0] != H or fc[1] % H:
        raise ValueError(f"{where}: no fc.weight of shape [{H}, n * {H}] (got {fc}); not an EAGLE head layout")
    n_in = fc[1] // H
    eagle3_marks = any(k.startswith("midlayer.") or k.endswith("hidden_norm.weight") for k in shapes)
    layout = "eagle3" if eagle3_marks or n_in >= 3 else "eagle" if n_in == 2 else "unknown"
    if layout != method:
        raise ValueError(f"{where}: the checkpoint has the {layout} layout (fc over {n_in} x hidden), "
                         f"not {method}'s; use method {layout!r}" if layout != "unknown" else
                         f"{where}: fc over {n_in} x hidden: not an EAGLE or EAGLE-3 layout")
    prefix = "midlayer." if any(k.startswith("midlayer.") for k in shapes) else "layers.0."
    required = [prefix + t for t in _LAYER_TENSORS] + ["fc.weight"]
    if method == "eagle3":
        required += [prefix + "input_layernorm.weight", prefix + "hidden_norm.weight", "norm.weight"]
    missing = [t for t in required if t not in shapes]
    if missing:
        raise ValueError(f"{where}: missing tensors {missing}")
    # (vLLM's conversion script adds the target's lm_head to EAGLE heads: taken as the head's own)
    allowed = set(required) | {prefix + t for t in _OPTIONAL_LAYER} | {
        "fc.bias", "embed_tokens.weight", prefix + "input_layernorm.weight", "lm_head.weight"}
    if method == "eagle3":
        allowed |= {"d2t", "t2d"}
    extra = sorted(k for k in shapes if k not in allowed and not k.endswith("rotary_emb.inv_freq"))
    if extra:
        raise ValueError(f"{where}: unexpected tensors {extra[:8]} (a head with more than one layer, or another "
                         f"layout, is not supported)")
    V = target_config.vocab_size
    if shapes.get("embed_tokens.weight", (V, H)) != (V, H):
        raise ValueError(f"{where}: embed_tokens {shapes['embed_tokens.weight']} does not match the target's "
                         f"vocabulary x hidden ({V}, {H})")
    draft_vocab = V
    if method == "eagle" and shapes.get("lm_head.weight", (V, H)) != (V, H):
        raise ValueError(f"{where}: lm_head {shapes['lm_head.weight']} is not the target's [{V}, {H}]")
    if method == "eagle3":
        draft_vocab = raw.get("draft_vocab_size") or V
        head = shapes.get("lm_head.weight")
        if head is not None and head != (draft_vocab, H):
            raise ValueError(f"{where}: lm_head {head} is not [draft_vocab_size {draft_vocab}, {H}]")
        if head is None and draft_vocab != V:
            raise ValueError(f"{where}: draft_vocab_size {draft_vocab} without an lm_head of its own")
        if draft_vocab > V:
            raise ValueError(f"{where}: draft_vocab_size {draft_vocab} exceeds the target's vocabulary {V}")
        if draft_vocab != V and shapes.get("d2t") != (draft_vocab,):
            raise ValueError(f"{where}: a draft vocabulary of {draft_vocab} needs d2t of shape [{draft_vocab}], "
                             f"got {shapes.get('d2t')}")
    aux: tuple[int, ...] = ()
    if method == "eagle3":
        L = target_config.num_hidden_layers
        ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids")
        aux = tuple(ids) if ids else (2, L // 2, L - 3)
        if len(aux) != n_in or not all(isinstance(i, int) and 0 <= i < L for i in aux):
            raise ValueError(f"{where}: auxiliary target layers {aux} must be {n_in} layer indices in [0, {L}) "
                             f"(fc takes {n_in} x hidden)")
    cfg = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "auto_map")})
    cfg.num_hidden_layers = 1
    # The head attends over the q/k/v it projects itself; check its shapes against the config.
    hd = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
    n_attn_in = 2 * H if method == "eagle3" else H
    want = {prefix + "self_attn.q_proj.weight": (cfg.num_attention_heads * hd, n_attn_in),
            prefix + "self_attn.k_proj.weight": ((cfg.num_key_value_heads or cfg.num_attention_heads) * hd, n_attn_in),
            prefix + "mlp.gate_proj.weight": (cfg.intermediate_size, H)}
    for name, shape in want.items():
        if shapes[name] != shape:
            raise ValueError(f"{where}: {name} has shape {shapes[name]}, the config says {shape}")
    return HeadInfo(method, directory, tuple(files), cfg, prefix, aux, draft_vocab, "embed_tokens.weight" in shapes,
                    "lm_head.weight" in shapes, "fc.bias" in shapes, prefix + "input_layernorm.weight" in shapes,
                    "d2t" in shapes, bool(raw.get("norm_before_residual", False)))


class _NoInputNorm(nn.Module):
    """EAGLE's layer 0 has no input norm: the pre-norm block's (x + residual, x + residual)."""

    def forward(self, x, residual):
        x = x + residual
        return x, x


class EagleLayer(DecoderLayer):
    """The EAGLE-3 layer: attention over concat(input_layernorm(embedding), hidden_norm(feature))."""

    def __init__(self, spec, rotary, norm_before_residual: bool):
        super().__init__(spec, 0, rotary)
        a = self.self_attn
        self.self_attn.qkv_proj = QKVParallelLinear(2 * spec.hidden_size, spec.head_dim, spec.num_heads,
                                                    spec.num_kv_heads, bias=spec.qkv_bias)
        a.num_heads, a.num_kv_heads = a.qkv_proj.num_heads, a.qkv_proj.num_kv_heads
        self.hidden_norm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.norm_before_residual = norm_before_residual

    def attn_inputs(self, embeds, feature):
        h = self.hidden_norm(feature)
        q, k, v = self.self_attn.qkv(torch.cat([self.input_layernorm(embeds), h], dim=-1))
        return q, k, v, h if self.norm_before_residual else feature


class EagleHead(nn.Module):
    """forward(token ids, positions, features) -> (the logits' input, the feature fed back)."""

    def __init__(self, info: HeadInfo, target: DecoderForCausalLM, max_model_len: int):
        super().__init__()
        cfg = info.config
        cfg.max_position_embeddings = max(cfg.max_position_embeddings or 0, max_model_len + 64)
        spec = decoder_spec(cfg)
        self.info, self.spec, self.eagle3 = info, spec, info.method == "eagle3"
        self.hidden_size = H = spec.hidden_size
        rotary = RotaryEmbedding(spec.head_dim, spec.max_position, spec.rope)
        rotary.fit_context(max_model_len)
        if self.eagle3:
            layer = EagleLayer(spec, rotary, info.norm_before_residual)
            self.norm = RMSNorm(H, spec.norm_eps)
        else:
            layer = DecoderLayer(spec, 0, rotary)
            if not info.input_norm:
                layer.input_layernorm = _NoInputNorm()
        self.layers = nn.ModuleList([layer])  # compiled like the target's (worker's compile_decoder_layers)
        n_in = len(info.aux_layers) * H if self.eagle3 else 2 * H
        self.fc = Linear(n_in, H, bias=info.fc_bias)
        self.embed_tokens = VocabParallelEmbedding(target.spec.vocab_size, H) if info.has_embed else None
        self.lm_head = Linear(H, info.draft_vocab_size) if info.has_lm_head else None
        # draft id -> target id (None: the same vocabulary)
        self.register_buffer("draft_to_target", torch.arange(info.draft_vocab_size) if info.has_d2t else None,
                             persistent=False)
        self._target = [target]  # not a submodule: its parameters are the target's

    @property
    def target(self) -> DecoderForCausalLM:
        return self._target[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.target.embed(input_ids) if self.embed_tokens is None else self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, feature: torch.Tensor):
        layer = self.layers[0]
        e = self.embed(input_ids)
        if not self.eagle3:
            x, residual = layer(positions, self.fc(torch.cat([e, feature], dim=-1)), torch.zeros_like(e))
            out = x + residual
            return out, out
        if feature.shape[-1] != self.hidden_size:  # the target's auxiliary streams, concatenated
            feature = self.fc(feature)
        q, k, v, residual = layer.attn_inputs(e, feature)
        x, residual = layer.attn_outputs(layer.self_attn.attn(q, k, v, positions), residual)
        return self.norm(x, residual)

    def compute_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (the target's when the head has no LM head)."""
        return self.target.compute_logits(x) if self.lm_head is None else linear(x, self.lm_head.weight)

    def load(self, tensors) -> None:
        info, layer = self.info, self.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        filled = set()
        for name, t in tensors:
            if name.endswith("rotary_emb.inv_freq") or name == "t2d":
                continue
            if name.startswith(info.layer_prefix):
                rel = name[len(info.layer_prefix):]
                module, _, param = rel.rpartition(".")
                proj = module.rsplit(".", 1)[-1]
                if proj in ("q_proj", "k_proj", "v_proj"):
                    attn.qkv_proj.load(param, t, proj[0])
                elif proj in ("gate_proj", "up_proj"):
                    mlp.gate_up_proj.load(param, t, proj[:-5])
                elif proj in ("o_proj", "down_proj"):
                    (attn.o_proj if proj == "o_proj" else mlp.down_proj).load(param, t)
                else:  # the norms
                    getattr(layer, module).weight.data.copy_(t)
            elif name == "d2t":
                self.draft_to_target.add_(t.to(self.draft_to_target))
            elif name == "norm.weight":
                self.norm.weight.data.copy_(t)
            else:
                module, _, param = name.rpartition(".")
                getattr(self, module).load(param, t)
            filled.add(name)
        expected = {n for n, _ in _expected_names(self)}
        if expected - filled:
            raise ValueError(f"EAGLE head {info.directory}: missing tensors {sorted(expected - filled)}")


def _expected_names(head: EagleHead):
    info, p = head.info, head.info.layer_prefix
    names = [p + t for t in _LAYER_TENSORS] + ["fc.weight"]
    names += ["fc.bias"] * info.fc_bias + ["embed_tokens.weight"] * info.has_embed
    if head.eagle3:
        names += [p + "input_layernorm.weight", p + "hidden_norm.weight", "norm.weight"]
        names += ["d2t"] * info.has_d2t
    elif info.input_norm:
        names.append(p + "input_layernorm.weight")
    names += ["lm_head.weight"] * info.has_lm_head
    return [(n, None) for n in names]


def build_head(info: HeadInfo, target, dtype: torch.dtype, device, max_model_len: int,
               random_weights: bool = False) -> EagleHead:
    """The head on `device` in `dtype`, its weights loaded (random N(0, 0.02) for performance runs)."""
    if not isinstance(target, DecoderForCausalLM) or not (target.is_first_stage and target.is_last_stage):
        raise ValueError(f"speculative_config: {info.method} heads draft for text decoder models on one rank only")
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            head = EagleHead(info, target, max_model_len)
    finally:
        torch.set_default_dtype(prev)
    head.eval()
    if random_weights:
        from splitserve.models.loader import init_random_weights
        init_random_weights(head)
    else:
        head.load(_tensors(list(info.files)))
    return head


def target_forward_with_aux(model: DecoderForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
                            aux_layers: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The target's forward (one rank, DecoderForCausalLM.forward's steps) that also returns the
    streams entering `aux_layers` (x + residual before the layer: HF's hidden_states[i])."""
    x, residual = model.start(model.embed(input_ids), positions)
    aux = {}
    for i, layer in enumerate(model.layers):
        if i in aux_layers:
            aux[i] = x + residual
        x, residual = layer(positions, x, residual)
    x, _ = model.norm(x, residual)
    return x, [aux[i] for i in aux_layers]
