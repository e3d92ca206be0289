"""Model families as data: what makes the one decoder (models/decoder.py) Llama, Gemma 2, OPT, ...

A family is a `Family` entry keyed by the config's `model_type`: the structural choices a config
does not spell out (norm kind and placement, MLP shape, which fields hold biases, scales and
multipliers) and a `WeightNames` map from the checkpoint's tensor names onto the decoder's modules.
`decoder_spec(config)` reads a config through its family into a `DecoderSpec` of plain numbers and
choices, which is all the decoder reads. Config fields that would change the math and that the
decoder does not implement are refused here, by name (`_REFUSED`), never ignored.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from splitserve.layers.rotary import rope_parameters
from splitserve.loading.text_config import layer_sliding_windows

# How a checkpoint tensor of a merged or interleaved projection is cut into the decoder's shards.
SPLIT_QKV = "split:qkv"            # [q; k; v] rows (Phi-3 qkv_proj)
SPLIT_GATE_UP = "split:gate_up"    # [gate; up] rows (Phi-3 gate_up_proj)
INTERLEAVED_QKV = "interleaved:qkv"  # per head [q_h; k_h; v_h] (Persimmon query_key_value)

_LLAMA_LAYER = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"), "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", "gate"), "mlp.up_proj": ("mlp.gate_up_proj", "up"),
}


@dataclass(frozen=True)
class WeightNames:
    """Checkpoint names -> the decoder's module names. `inner`: what follows `model.` before the
    decoder's own names (OPT's `decoder.`); `top`: renamed modules outside the layers; `layer`:
    a module of a layer -> (decoder module, shard of a merged layer, a SPLIT_* / INTERLEAVED_* cut,
    or None). Modules not named keep their names (o_proj, down_proj, the norms...)."""
    inner: str = ""
    top: dict[str, str] = field(default_factory=dict)
    layer: dict[str, tuple[str, str | None]] = field(default_factory=lambda: dict(_LLAMA_LAYER))

    def checkpoint_modules(self, module: str) -> tuple[str, ...]:
        """The checkpoint modules (relative to a layer) a decoder module stands for, in shard order:
        how a quantization config, which names checkpoint modules, finds each layer's method."""
        names = tuple(src for src, (dst, _) in self.layer.items() if dst == module)
        return names or (module,)


@dataclass(frozen=True)
class Family:
    norm: str = "rms"                    # rms | gemma_rms (stores w - 1) | layer (LayerNorm with bias) | layer1p (Nemotron: stores w - 1)
    eps_field: str | None = "rms_norm_eps"  # None: LayerNorm's default 1e-5 (OPT)
    sandwich: bool = False               # Gemma 2: norms after attention and MLP as well as before
    mlp: str = "gated"                   # gated (gate_up_proj, down_proj) | plain (up_proj, down_proj) | moe
    act_field: str = "hidden_act"
    intermediate_field: str = "intermediate_size"
    learned_positions: int | None = None  # offset of learned absolute positions (OPT: 2); None: RoPE
    sinusoidal_positions: bool = False   # fixed sin/cos table at position + pad_token_id + 1 (Kosmos-2)
    inner_attn_norm: bool = False        # LayerNorm on the attention output before o_proj (Kosmos-2)
    mlp_norm: bool = False               # LayerNorm between the activation and down_proj (Kosmos-2)
    qk_norm: str | None = None           # rms (Qwen3) | layer (Persimmon) | layer_per_head (StableLM)
    qk_norm_field: str | None = None     # the config flag that turns qk_norm on (None: always on)
    # True / False, or the config field that says (absent: False)
    qkv_bias: bool | str = "attention_bias"
    o_bias: bool | str = "attention_bias"
    mlp_bias: bool | str = "mlp_bias"
    scale: str = "head_dim"              # head_dim | query_pre_attn_scalar (Gemma 2) | attention_multiplier (Granite)
    embed_scale: str | None = None       # sqrt_hidden (Gemma) | embedding_multiplier (Granite) |
    #                                      scale_embedding (Kosmos-2: sqrt(hidden) on the inputs, image features too)
    multipliers: bool = False            # Granite's residual_multiplier and logits_scaling
    soft_caps: bool = False              # Gemma 2's attn_logit_softcapping / final_logit_softcapping
    embed_norm: bool = False             # LayerNorm on the input stream after positions (mBART's layernorm_embedding)
    layers_field: str = "num_hidden_layers"     # mBART: decoder_layers (its num_hidden_layers is the encoder's)
    heads_field: str = "num_attention_heads"    # mBART: decoder_attention_heads
    names: WeightNames = field(default_factory=WeightNames)


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(qkv_bias=True, o_bias=False),
    "qwen3": Family(qk_norm="rms"),
    "granite": Family(scale="attention_multiplier", embed_scale="embedding_multiplier", multipliers=True),
    "gemma2": Family(norm="gemma_rms", sandwich=True, act_field="hidden_activation", scale="query_pre_attn_scalar",
                     embed_scale="sqrt_hidden", soft_caps=True, mlp_bias=False),
    "phi3": Family(qkv_bias=False, o_bias=False, mlp_bias=False, names=WeightNames(layer={
        "self_attn.qkv_proj": ("self_attn.qkv_proj", SPLIT_QKV), "mlp.gate_up_proj": ("mlp.gate_up_proj", SPLIT_GATE_UP)})),
    "opt": Family(norm="layer", eps_field=None, mlp="plain", act_field="activation_function",
                  intermediate_field="ffn_dim", learned_positions=2, qkv_bias="enable_bias", o_bias="enable_bias",
                  mlp_bias="enable_bias", names=WeightNames(inner="decoder.", top={"final_layer_norm": "norm"}, layer={
                      **{k: v for k, v in _LLAMA_LAYER.items() if k.startswith("self_attn")},
                      "self_attn.out_proj": ("self_attn.o_proj", None), "fc1": ("mlp.up_proj", None),
                      "fc2": ("mlp.down_proj", None), "self_attn_layer_norm": ("input_layernorm", None),
                      "final_layer_norm": ("post_attention_layernorm", None)})),
    "persimmon": Family(norm="layer", eps_field="layer_norm_eps", mlp="plain", qk_norm="layer",
                        qk_norm_field="qk_layernorm", qkv_bias=True, o_bias=True, mlp_bias=True,
                        names=WeightNames(top={"final_layernorm": "norm"}, layer={
                            "self_attn.query_key_value": ("self_attn.qkv_proj", INTERLEAVED_QKV),
                            "self_attn.dense": ("self_attn.o_proj", None),
                            "self_attn.q_layernorm": ("self_attn.q_norm", None),
                            "self_attn.k_layernorm": ("self_attn.k_norm", None),
                            "mlp.dense_h_to_4h": ("mlp.up_proj", None), "mlp.dense_4h_to_h": ("mlp.down_proj", None)})),
    "stablelm": Family(norm="layer", eps_field="layer_norm_eps", qk_norm="layer_per_head", qk_norm_field="qk_layernorm",
                       qkv_bias="use_qkv_bias", o_bias=False, mlp_bias=False, names=WeightNames(layer={
                           **_LLAMA_LAYER, "self_attn.q_layernorm": ("self_attn.q_norm", None),
                           "self_attn.k_layernorm": ("self_attn.k_norm", None)})),
    "kosmos_2_text_model": Family(
        norm="layer", eps_field="layer_norm_eps", mlp="plain", act_field="activation_function",
        intermediate_field="ffn_dim", sinusoidal_positions=True, inner_attn_norm=True, mlp_norm=True,
        qkv_bias=True, o_bias=True, mlp_bias=True, embed_scale="scale_embedding", names=WeightNames(
            top={"layer_norm": "norm"}, layer={
                **{k: v for k, v in _LLAMA_LAYER.items() if k.startswith("self_attn")},
                "self_attn.out_proj": ("self_attn.o_proj", None), "ffn.fc1": ("mlp.up_proj", None),
                "ffn.fc2": ("mlp.down_proj", None), "ffn.ffn_layernorm": ("mlp.ffn_layernorm", None),
                "self_attn_layer_norm": ("input_layernorm", None),
                "final_layer_norm": ("post_attention_layernorm", None)})),
    # mBART's decoder (MBartForCausalLM; Nougat's decoder, with cross-attention: models/nougat/model.py):
    # OPT-like pre-norm layers, learned positions at offset 2, sqrt(d_model) embedding scale and a
    # LayerNorm on the embeddings. Cross-attention tensors go to DecoderCrossAttention.
    "mbart": Family(norm="layer", eps_field=None, mlp="plain", act_field="activation_function",
                    intermediate_field="decoder_ffn_dim", learned_positions=2, qkv_bias=True, o_bias=True,
                    mlp_bias=True, embed_scale="scale_embedding", embed_norm=True, layers_field="decoder_layers",
                    heads_field="decoder_attention_heads", names=WeightNames(
                        inner="decoder.", top={"layer_norm": "norm", "layernorm_embedding": "embed_norm"}, layer={
                            **{k: v for k, v in _LLAMA_LAYER.items() if k.startswith("self_attn")},
                            "self_attn.out_proj": ("self_attn.o_proj", None), "fc1": ("mlp.up_proj", None),
                            "fc2": ("mlp.down_proj", None), "self_attn_layer_norm": ("input_layernorm", None),
                            "final_layer_norm": ("post_attention_layernorm", None),
                            "encoder_attn.q_proj": ("cross_attn.q_proj", None),
                            "encoder_attn.k_proj": ("cross_attn.kv_proj", "k"),
                            "encoder_attn.v_proj": ("cross_attn.kv_proj", "v"),
                            "encoder_attn.out_proj": ("cross_attn.o_proj", None),
                            "encoder_attn_layer_norm": ("cross_attn.norm", None)})),
    "mixtral": Family(mlp="moe"),
    # Nemotron / NVGPT (NeVA's decoder): LayerNorm1P, squared ReLU up/down MLP, partial rotary
    "nemotron": Family(norm="layer1p", eps_field="norm_eps", mlp="plain", names=WeightNames(
        layer={k: v for k, v in _LLAMA_LAYER.items() if k.startswith("self_attn")})),
    "qwen2_moe": Family(mlp="moe", qkv_bias="qkv_bias", o_bias=False, mlp_bias=False),
}

# model_type -> architecture name: loading/architectures.py (config reading needs it below models/)


def _is(value, *allowed) -> bool:
    return value is None or value in allowed


# Config fields that change the math and that the decoder does not implement: field -> (the test
# its value must pass, what it would need). Checked for every family (a field a family's config
# lacks is absent, so passes). Not here: training-only fields (dropouts, router noise, aux losses)
# and Llama's pretraining_tp (the same products sliced differently; transformers ignores it too).
_REFUSED = {
    "use_parallel_residual": (lambda v, c: not v, "attention and MLP in parallel from one norm"),
    "do_layer_norm_before": (lambda v, c: v is None or v, "post-norm layers (OPT-350m)"),
    "_remove_final_layer_norm": (lambda v, c: not v, "no final layer norm"),
    "layer_norm_elementwise_affine": (lambda v, c: v is None or v, "layer norms without weights"),
    "word_embed_proj_dim": (lambda v, c: _is(v, c.hidden_size), "projected word embeddings (project_in/out)"),
    "use_bidirectional_attention": (lambda v, c: not v, "bidirectional attention"),
    "add_cross_attention": (lambda v, c: not v, "cross-attention layers in the decoder"),
    "attention_chunk_size": (lambda v, c: v is None, "chunked local attention"),
    "no_rope_layers": (lambda v, c: not v or all(v), "layers without RoPE"),
    "layer_types": (lambda v, c: not v or set(v) <= {"sliding_attention", "full_attention"}, "other attention types"),
}


def _check_refused(config, family: Family, model_type: str, cross_attention: bool = False) -> None:
    for name, (ok, what) in _REFUSED.items():
        if cross_attention and name == "add_cross_attention":
            continue  # the caller is an encoder-decoder model that feeds the cross-attention
        value = getattr(config, name, None)
        if not ok(value, config):
            raise ValueError(f"{model_type} config field {name}={value!r} is not supported ({what}); "
                             f"refusing to load a model that would compute something else")
    # A family's own optional features, set in a config of a family that does not read them: each
    # field with the values that leave the math alone.
    one, off = (None, 1, 1.0), (None, False, 0, 0.0)
    foreign = {
        "query_pre_attn_scalar": (family.scale != "query_pre_attn_scalar", (None,)),
        "attention_multiplier": (family.scale != "attention_multiplier", one),
        "embedding_multiplier": (family.embed_scale != "embedding_multiplier", one),
        "residual_multiplier": (not family.multipliers, one), "logits_scaling": (not family.multipliers, one),
        "attn_logit_softcapping": (not family.soft_caps, off), "final_logit_softcapping": (not family.soft_caps, off),
        "qk_layernorm": (family.qk_norm is None, off), "use_qk_norm": (True, off),
        "num_local_experts": (family.mlp != "moe", off), "num_experts": (family.mlp != "moe", off),
    }
    for name, (unread, neutral) in foreign.items():
        value = getattr(config, name, None)
        if unread and not any(value is n or (type(value) is type(n) and value == n) for n in neutral):
            raise ValueError(f"{model_type} config field {name}={value!r} is not supported for this family; "
                             f"refusing to ignore it")


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    shared_intermediate_size: int = 0
    dense_layers: frozenset[int] = frozenset()  # layers with a plain gated MLP instead (Qwen2-MoE)


@dataclass(frozen=True)
class DecoderSpec:
    """Everything the decoder reads, resolved from a config through its family."""
    model_type: str
    family: Family
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int
    norm_eps: float
    activation: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: str | None
    rope: dict | None                   # rope_parameters(config); None: learned positions
    scale: float
    windows: tuple[int | None, ...]     # per layer
    attn_soft_cap: float | None
    final_soft_cap: float | None
    tie_word_embeddings: bool
    embed_scale: float | None           # applied to token embeddings (Gemma), in the model's dtype
    embedding_multiplier: float | None  # applied to the decoder's input embeddings (Granite)
    residual_multiplier: float | None
    logits_scaling: float | None
    moe: MoESpec | None
    position_offset: int = 0            # sinusoidal positions: table row of position 0
    cross_attention: bool = False       # a cross-attention block per layer (encoder-decoder models)

    @property
    def rot_dim(self) -> int:
        return 0 if self.rope is None else int(self.head_dim * (self.rope.get("partial_rotary_factor") or 1.0))

    @property
    def attn_variants(self) -> tuple[tuple[int | None, float | None], ...]:
        """The layers' distinct (window, soft cap) pairs, as the attention kernels are specialised."""
        return tuple(sorted({(w, self.attn_soft_cap) for w in self.windows}, key=lambda v: v[0] or 0))


def _flag(config, choice: bool | str) -> bool:
    return bool(getattr(config, choice, False)) if isinstance(choice, str) else choice


def _multiplier(config, name: str) -> float | None:
    value = getattr(config, name, None)
    return None if value is None or value == 1.0 else float(value)


def family_of(config) -> tuple[str, Family]:
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported by the decoder "
                         f"(supported: {', '.join(sorted(FAMILIES))})")
    return model_type, FAMILIES[model_type]


def _moe_spec(config, model_type: str) -> MoESpec:
    if model_type == "mixtral":
        return MoESpec(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size, True)
    n = config.num_hidden_layers
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = {i for i in range(n) if i in set(getattr(config, "mlp_only_layers", None) or [])
             or config.num_experts == 0 or (i + 1) % step != 0}
    return MoESpec(config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                   bool(getattr(config, "norm_topk_prob", False)),
                   getattr(config, "shared_expert_intermediate_size", 0) or 0, frozenset(dense))


def decoder_spec(config, cross_attention: bool = False) -> DecoderSpec:
    """The decoder's choices for a config; ValueError naming the field for anything it cannot compute.
    cross_attention: the decoder of an encoder-decoder model (a config's add_cross_attention is
    refused otherwise: a decoder alone has no encoder output to attend to)."""
    model_type, fam = family_of(config)
    _check_refused(config, fam, model_type, cross_attention)
    if cross_attention and (fam.sandwich or fam.multipliers or fam.inner_attn_norm):
        raise ValueError(f"{model_type}: cross-attention is supported in plain pre-norm layers only")
    hidden, heads = config.hidden_size, getattr(config, fam.heads_field)
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    act = getattr(config, fam.act_field, None) or "silu"
    qk_norm = fam.qk_norm if fam.qk_norm_field is None or getattr(config, fam.qk_norm_field, False) else None
    if fam.scale == "query_pre_attn_scalar":
        scale = config.query_pre_attn_scalar ** -0.5
    elif fam.scale == "attention_multiplier":
        scale = float(config.attention_multiplier)
    else:
        scale = head_dim ** -0.5
    embed_scale = math.sqrt(hidden) if fam.embed_scale == "sqrt_hidden" else None
    caps = [getattr(config, f, None) if fam.soft_caps else None
            for f in ("attn_logit_softcapping", "final_logit_softcapping")]
    n = getattr(config, fam.layers_field)
    windows = tuple(layer_sliding_windows(config)) if fam.layers_field == "num_hidden_layers" else (None,) * n
    if len(windows) != n:
        raise ValueError(f"{model_type} config: {len(windows)} layer_types for {n} layers")
    return DecoderSpec(
        model_type=model_type, family=fam, hidden_size=hidden,
        intermediate_size=getattr(config, fam.intermediate_field), num_layers=n, num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
        vocab_size=config.vocab_size, max_position=config.max_position_embeddings,
        norm_eps=getattr(config, fam.eps_field) if fam.eps_field else 1e-5, activation=act,
        qkv_bias=_flag(config, fam.qkv_bias), o_bias=_flag(config, fam.o_bias), mlp_bias=_flag(config, fam.mlp_bias),
        qk_norm=qk_norm, rope=None if fam.learned_positions is not None or fam.sinusoidal_positions
        else rope_parameters(config), scale=scale,
        windows=tuple(w or None for w in windows), attn_soft_cap=caps[0] or None, final_soft_cap=caps[1] or None,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)), embed_scale=embed_scale,
        embedding_multiplier=(_multiplier(config, "embedding_multiplier") if fam.embed_scale == "embedding_multiplier"
                              else math.sqrt(hidden) if fam.embed_scale == "scale_embedding"
                              and getattr(config, "scale_embedding", False) else None),
        residual_multiplier=_multiplier(config, "residual_multiplier") if fam.multipliers else None,
        logits_scaling=_multiplier(config, "logits_scaling") if fam.multipliers else None,
        moe=_moe_spec(config, model_type) if fam.mlp == "moe" else None,
        position_offset=(getattr(config, "pad_token_id", None) or 0) + 1 if fam.sinusoidal_positions else 0,
        cross_attention=cross_attention)
