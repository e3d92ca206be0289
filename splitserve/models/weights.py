"""Checkpoint tensors into the decoder: HF names through the family's `WeightNames` onto modules.

One loader for every family and for GGUF files (whose reader yields HF names and HF-convention
values). A tensor that no parameter takes is an error naming it: a silently dropped tensor is a
wrong model. Tensors may be lazy checkpoint slices (tensor / pipeline parallelism): each layer reads
only this rank's part of them, and a stage nothing of the layers it does not hold.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from splitserve.attention.layer import Attention, kv_scale_targets
from splitserve.layers.linear import Linear
from splitserve.layers.parallel_linear import VocabParallelEmbedding
from splitserve.layers.quantization.base import as_tensor, copy_checkpoint_tensor
from splitserve.models.families import INTERLEAVED_QKV, SPLIT_GATE_UP, SPLIT_QKV, DecoderSpec


def _decoder_name(model, full_name: str) -> str:
    """A checkpoint name in the decoder's own module names (stage-independent)."""
    names = model.spec.family.names
    name = full_name[len("model."):] if full_name.startswith("model.") else full_name
    if names.inner and name.startswith(names.inner):
        name = name[len(names.inner):]
    module, _, param = name.rpartition(".")
    if module in names.top:
        name = f"{names.top[module]}.{param}"
    return name


def _stage_name(model, name: str) -> str | None:
    """A decoder name as this stage's module path, or None for a tensor of another pipeline stage
    (layers elsewhere, the embeddings, the final norm, the head)."""
    if name.startswith("layers."):
        _, index, rest = name.split(".", 2)
        i = int(index)
        if i >= model.spec.num_layers:
            return name  # no stage has it: the error below names it
        if not model.start_layer <= i < model.end_layer:
            return None
        return f"layers.{i - model.start_layer}.{rest}"
    if name.startswith("embed_tokens.") and model.embed_tokens is None:
        return None
    if name.startswith("embed_positions.") and model.embed_positions is None:
        return None
    if name.startswith("embed_norm.") and model.embed_norm is None:
        return None
    if name.startswith("norm.") and model.norm is None:
        return None
    if name.startswith("lm_head.") and (model.lm_head is None or model.head_from_embedding):
        return None  # tied (the embedding is the head) or another stage's
    return name


def _route(model, name: str) -> tuple[str, str, str | None]:
    """(module path, parameter path under it, shard or cut) of a stage name."""
    if name.startswith("layers."):
        _, index, rel = name.split(".", 2)
        for src, (dst, how) in model.spec.family.names.layer.items():
            if rel.startswith(src + "."):
                return f"layers.{index}.{dst}", rel[len(src) + 1:], how
    module, _, param = name.rpartition(".")
    return module, param, None


def _merged_pieces(spec: DecoderSpec, layer: Linear, param: str, tensor, how: str):
    """(shard, piece) of a checkpoint tensor that holds several shards of a merged layer."""
    if how == INTERLEAVED_QKV:  # [heads, (q, k, v), head_dim, ...]: whole tensors only
        t = as_tensor(tensor)
        per_head = t.reshape(spec.num_heads, 3, spec.head_dim, *t.shape[1:])
        return [(s, per_head[:, j].reshape(spec.num_heads * spec.head_dim, *t.shape[1:]))
                for j, s in enumerate("qkv")]
    if how == SPLIT_QKV:
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        sizes = {"q": q, "k": kv, "v": kv}
    else:
        assert how == SPLIT_GATE_UP, how
        sizes = {"gate": spec.intermediate_size, "up": spec.intermediate_size}
    layout = layer.param_layouts.get(param)
    if layout is not None and layout.per_shard:  # one value for the whole merged tensor: every shard's
        return [(s, tensor) for s in sizes]
    dim, pf = (0, 1) if layout is None else (layout.output_dim, layout.pack_factor)
    if dim is None or any(n % pf for n in sizes.values()):
        raise ValueError(f"{param}: cannot cut a merged checkpoint tensor of shape {tuple(tensor.shape)} into "
                         f"{'/'.join(sizes)} shards")
    pieces, start = [], 0
    for shard, n in sizes.items():
        pieces.append((shard, tensor.narrow(dim, start // pf, n // pf)))
        start += n
    return pieces


def load_decoder_weights(model, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    from splitserve.layers.moe.layer import FusedMoE, checkpoint_target
    spec: DecoderSpec = model.spec
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for full_name, tensor in weights:
        name = _decoder_name(model, full_name)
        # Deliberately unused: rotary tables (recomputed), a tied head's copy of the embedding,
        # and what the quantization format says the engine does not use. KV-cache scales go to the
        # attention layers (used when the KV cache is FP8).
        if "rotary_emb.inv_freq" in name:
            continue
        if name == "embed_tokens.weight" and model.head_from_embedding:
            model.lm_head.load("weight", tensor)
            loaded.add("lm_head.weight")
        name = _stage_name(model, name)
        if name is None:
            continue
        kv_scales = kv_scale_targets(name)
        if kv_scales:  # FP8 KV-cache scales: buffers of the attention layer, not parameters
            for attn, which in kv_scales:
                if not isinstance(modules.get(attn), Attention):
                    raise ValueError(f"{name}: the model has no attention layer {attn} for this KV-cache scale")
                modules[attn].load_kv_scale(which, as_tensor(tensor))
            continue
        if model.quant_config is not None and model.quant_config.skip_tensor(full_name):
            continue
        if name.startswith("layers."):  # a mixture-of-experts tensor goes to the layer's FusedMoE
            _, index, rel = name.split(".", 2)
            moe = modules.get(f"layers.{index}.mlp")
            target = checkpoint_target(rel) if isinstance(moe, FusedMoE) else None
            if target is not None:
                moe.load(target[0], as_tensor(tensor), target[1], target[2])
                loaded.add(f"layers.{index}.mlp.{target[0]}")
                continue
        module_name, param, how = _route(model, name)
        if ".cross_attn." in module_name + "." and not spec.cross_attention:
            continue  # mBART's decoder alone holds cross-attention weights it uses only with an encoder
        module = modules.get(module_name)
        try:
            if isinstance(module, Linear):
                shard = how if how in module.shard_offsets else None
                if how is not None and shard is None:
                    for piece_shard, piece in _merged_pieces(spec, module, param, tensor, how):
                        module.load(param, piece, piece_shard)
                else:
                    module.load(param, tensor, shard)
                if param == "bias" and getattr(module, "output_bias", None) is not None:
                    param = "output_bias"  # a row-parallel bias, added after the all-reduce
                loaded.add(f"{module_name}.{param}")
                continue
            if isinstance(module, VocabParallelEmbedding):
                module.load(param, tensor)
                loaded.add(f"{module_name}.{param}")
                continue
            if hasattr(module, "load_checkpoint"):
                loaded.add(f"{module_name}.{module.load_checkpoint(param, as_tensor(tensor))}")
                continue
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {full_name!r}: {e}") from None
        target = f"{module_name}.{param}"
        if target in params:
            _copy(params[target], target, as_tensor(tensor))
            loaded.add(target)
        else:
            raise ValueError(f"checkpoint tensor {full_name!r} matches no parameter of the model "
                             f"({spec.model_type} decoder); refusing to drop it silently")
    for module_name, module in modules.items():
        if isinstance(module, FusedMoE) and module.missing_weights():
            raise ValueError(f"checkpoint is missing {module_name} weights: {module.missing_weights()[:8]}")
    return loaded


def _copy(param: nn.Parameter, name: str, tensor: torch.Tensor) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}")
    param.data.copy_(tensor)


# -- vision-language checkpoints: a declarative name map -----------------------------------------------
@dataclass(frozen=True)
class WeightRoute:
    """One rule of a VLM checkpoint's name map. Rules are tried in order on each checkpoint name; the
    first that matches takes the tensor. `match` is a name prefix (ending in "." or empty), or a whole
    name (anything else). `rest` below is the name after `match`. Kinds:

    text     the language model's tensor, named `to` + rest
    tower    `model.<to>.load_weight(rest)` (a vision tower or side: replicated, read whole; `whole_name`
             passes the checkpoint name instead); it returns the parameter it filled, or None for a
             tensor it does not use
    param    the model's own parameter `to` + rest (shape-checked); where there is none, later rules
    linear   `model.<to>.load(rest, tensor)`: an engine Linear of the model's own (Fuyu's patch projection)
    rename   the name becomes `to` + rest and the later rules are tried on it
    refuse   no rule takes it: an error
    """
    match: str
    kind: str
    to: str = ""
    whole_name: bool = False

    def matches(self, name: str) -> bool:
        return name.startswith(self.match) if self.match.endswith(".") or not self.match else name == self.match


def load_routed_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                        routes: tuple[WeightRoute, ...]) -> set[str]:
    """A VLM's checkpoint through its name map (`routes`): the language model's tensors stream into
    `model.language_model.load_weights`, the rest land in the model's own modules as they pass. Returns
    every parameter name filled (the language model's under `language_model.`)."""
    loaded: set[str] = set()
    params = dict(model.named_parameters())

    def text_weights():
        for name, tensor in weights:
            taken = False
            for route in routes:
                if not route.matches(name):
                    continue
                rest = name[len(route.match):]
                if route.kind == "rename":
                    name = route.to + rest
                    continue
                if route.kind == "param" and route.to + rest not in params:
                    continue
                if route.kind == "refuse":
                    break
                taken = True
                if route.kind == "text":
                    yield route.to + rest, tensor
                elif route.kind == "tower":
                    filled = getattr(model, route.to).load_weight(name if route.whole_name else rest, as_tensor(tensor))
                    if filled:
                        loaded.add(f"{route.to}.{filled}")
                elif route.kind == "param":
                    copy_checkpoint_tensor(params[route.to + rest], tensor, name)
                    loaded.add(route.to + rest)
                elif route.kind == "linear":
                    getattr(model, route.to).load(rest, as_tensor(tensor))
                    loaded.add(f"{route.to}.{rest}")
                else:
                    raise ValueError(f"unknown weight route kind {route.kind!r}")
                break
            if not taken:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}")

    loaded |= {f"language_model.{n}" for n in model.language_model.load_weights(text_weights())}
    return loaded
