"""Llama-family decoder (Llama 2/3, Mistral-style, Qwen2-style QKV bias) on the flat token stream.

Every layer here is batchful: it sees [num_tokens, hidden] with the tokens of all requests of the step
concatenated. Only `Attention` (the custom op) knows which token belongs to which sequence.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from splitserve.attention.layer import Attention, kv_scale_targets
from splitserve.distributed.communication import Intermediate, tp_all_gather
from splitserve.distributed.parallel_state import pp_group, stage_layers, tp_group
from splitserve.layers.activation import silu_and_mul
from splitserve.layers.cpu_gemm import linear
from splitserve.layers.linear import Linear
from splitserve.layers.parallel_linear import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                                               RowParallelLinear, VocabParallelEmbedding)
from splitserve.layers.quantization.base import QuantConfig, as_tensor, method_for
from splitserve.layers.norm import RMSNorm
from splitserve.layers.rotary import RotaryEmbedding, rope_parameters
from splitserve.models.text_config import layer_sliding_windows


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, bias: bool, rotary: RotaryEmbedding,
                 quant_config: QuantConfig | None = None, prefix: str = "self_attn", model_layer: int | None = None):
        """layer_idx: the stage's index of the layer (its KV cache); model_layer: the model's (the
        checkpoint's and the config's per-layer settings), the same without pipeline stages."""
        super().__init__()
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        # This tensor-parallel rank's heads (all of them on one device).
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, num_heads, num_kv_heads, bias=bias,
                                          method=method_for(quant_config, *(f"{prefix}.{p}_proj" for p in "qkv")))
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, config.hidden_size,
                                        bias=getattr(config, "attention_bias", False) and bias,
                                        method=method_for(quant_config, f"{prefix}.o_proj"))
        # The rotary table (one for all layers) goes to the attention op, which rotates q and k
        # where it stores the cache (one pass over them instead of two).
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5,
                              rotary, sliding_window=layer_sliding_windows(config)[
                                  layer_idx if model_layer is None else model_layer])

    def qkv(self, x: torch.Tensor):
        """The attention op's inputs: q [T, Hq * D], k and v [T, Hkv * D], views of one projection."""
        return self.qkv_proj.split(self.qkv_proj(x))


class LlamaMLP(nn.Module):
    def __init__(self, config, quant_config: QuantConfig | None = None, prefix: str = "mlp"):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, {"gate": config.intermediate_size, "up": config.intermediate_size}, bias=bias,
            method=method_for(quant_config, f"{prefix}.gate_proj", f"{prefix}.up_proj"))
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias,
                                           method=method_for(quant_config, f"{prefix}.down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


def start_residual(x: torch.Tensor) -> torch.Tensor:
    """The residual stream before the first layer: zeros, so that layer 0's norm(x + residual) is
    exactly norm(x) and every layer runs the same code."""
    return torch.zeros_like(x)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, qkv_bias: bool, rotary: RotaryEmbedding,
                 quant_config: QuantConfig | None = None, prefix: str = "", model_layer: int | None = None):
        """layer_idx: the layer's index among this pipeline stage's layers (its KV cache's index);
        model_layer: its index in the whole model (None: the same)."""
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, qkv_bias, rotary, quant_config, f"{prefix}self_attn",
                                        model_layer)
        self.mlp = LlamaMLP(config, quant_config, f"{prefix}mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    # The layer in two batchful halves around the batchless attention op. Compiled (and, for
    # piecewise CUDA graphs, captured) separately; forward is just the two with the op between.
    # The residual is always a tensor (zeros before the first layer, see start_residual): one compiled
    # graph per half, where a None there would make dynamo compile a second one for layer 0.
    def attn_inputs(self, x, residual):
        x, residual = self.input_layernorm(x, residual)
        q, k, v = self.self_attn.qkv(x)
        return q, k, v, residual

    def attn_outputs(self, attn_out, residual):
        x, residual = self.post_attention_layernorm(self.self_attn.o_proj(attn_out), residual)
        return self.mlp(x), residual

    def forward(self, positions, x, residual):
        q, k, v, residual = self.attn_inputs(x, residual)
        return self.attn_outputs(self.self_attn.attn(q, k, v, positions), residual)


class LlamaForCausalLM(nn.Module):
    """The decoder, or this rank's part of it: the tensor-parallel group (parallel_state.tp_group())
    splits every layer's heads and features; the pipeline group (pp_group()) gives each stage a
    contiguous run of layers (stage_layers), the first stage the embedding and the last the final
    norm and the LM head. `forward` of a stage that is not the last returns an Intermediate
    (hidden, residual) that the next stage's forward takes as `intermediate`."""

    # Qwen2 checkpoints always carry q/k/v biases; Llama ones only with attention_bias=true.
    qkv_bias_default = False

    def __init__(self, config, quant_config: QuantConfig | None = None, prefix: str = "model",
                 head_name: str = "lm_head"):
        """`prefix` / `head_name`: the checkpoint's module names of the decoder and the LM head, by
        which a quantization config picks each layer's method (VLMs nest the decoder deeper)."""
        super().__init__()
        self.config = config
        self.quant_config = quant_config
        pp = pp_group()
        self.tp_size = tp_group().world_size
        self.is_first_stage, self.is_last_stage = pp.is_first, pp.is_last
        self.start_layer, self.end_layer = stage_layers(config.num_hidden_layers, pp.rank, pp.world_size)
        qkv_bias = getattr(config, "attention_bias", self.qkv_bias_default) or self.qkv_bias_default
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size) if pp.is_first else None
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary = RotaryEmbedding(head_dim, config.max_position_embeddings, rope_parameters(config))
        # Layer i of the checkpoint is this stage's layer i - start_layer (its KV cache's index).
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i - self.start_layer, qkv_bias, rotary, quant_config, f"{prefix}.layers.{i}.", i)
            for i in range(self.start_layer, self.end_layer))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if pp.is_last else None
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # A tied head is the embedding; a last stage without the embedding loads its own copy of it.
        self.head_from_embedding = self.tie_word_embeddings and pp.is_last and not pp.is_first
        if not pp.is_last or (self.tie_word_embeddings and pp.is_first):
            self.lm_head = None
        else:
            method = None if self.head_from_embedding else method_for(quant_config, head_name)
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, method=method)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None,
                intermediate: Intermediate | None = None) -> torch.Tensor | Intermediate:
        """[T] token ids and positions -> [T, hidden] final hidden states (the last pipeline stage),
        or the Intermediate stream for the next stage. Stages after the first start from
        `intermediate` (the previous stage's output) and ignore input_ids / inputs_embeds."""
        if self.is_first_stage:
            x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
            residual = start_residual(x)
        elif intermediate is None:
            raise ValueError("a pipeline stage after the first needs the previous stage's intermediate")
        else:
            x, residual = intermediate  # an Intermediate, or the plain pair the transfer received
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        if not self.is_last_stage:
            return Intermediate(x, residual)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits in the model's dtype (into `out` when given). The sampler converts to fp32 only what
        needs it: a greedy batch takes the argmax of these directly (exact, as the conversion is).
        With tensor parallelism each rank computes its vocabulary rows and all gather them."""
        if self.tp_size > 1:
            local = (linear(hidden, self.embed_tokens.weight) if self.lm_head is None
                     else self.lm_head(hidden))
            logits = tp_all_gather(local)[..., :self.config.vocab_size]
            return logits if out is None else out.copy_(logits)
        if self.lm_head is not None and self.lm_head.is_quantized:  # a format that quantizes the head
            logits = self.lm_head(hidden)
            return logits if out is None else out.copy_(logits)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if out is None:
            return linear(hidden, weight)
        return torch.mm(hidden, weight.t(), out=out)

    # -- weights ---------------------------------------------------------------------------------
    _STACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}

    def _stage_name(self, name: str) -> str | None:
        """A checkpoint name (without `model.`) as this stage's module path, or None for a tensor of
        another pipeline stage (layers elsewhere, the embedding, the final norm, the head)."""
        if name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            i = int(index)
            if i >= self.config.num_hidden_layers:
                return name  # no stage has it: the loader's error names it
            if not self.start_layer <= i < self.end_layer:
                return None
            return f"layers.{i - self.start_layer}.{rest}"
        if name.startswith("embed_tokens.") and self.embed_tokens is None:
            return None
        if name.startswith("norm.") and self.norm is None:
            return None
        if name.startswith("lm_head.") and (self.lm_head is None or self.head_from_embedding):
            return None  # tied (the embedding is the head) or another stage's
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads HF-named tensors; returns the names of parameters that were filled. A tensor that
        no parameter takes is an error naming it: a silently dropped tensor is a wrong model.
        Tensors may be lazy checkpoint slices: each layer reads only this rank's part of them."""
        modules = dict(self.named_modules())
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for full_name, tensor in weights:
            name = full_name[len("model."):] if full_name.startswith("model.") else full_name
            # Deliberately unused: rotary tables (recomputed), a tied head's copy of the embedding,
            # and what the quantization format says the engine does not use. KV-cache scales go to the
            # attention layers (used when the KV cache is FP8).
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "embed_tokens.weight" and self.head_from_embedding:
                self.lm_head.load("weight", tensor)
                loaded.add("lm_head.weight")
            name = self._stage_name(name)
            if name is None:
                continue
            kv_scales = kv_scale_targets(name)
            if kv_scales:  # FP8 KV-cache scales: buffers of the attention layer, not parameters
                for attn, which in kv_scales:
                    if not isinstance(modules.get(attn), Attention):
                        raise ValueError(f"{name}: the model has no attention layer {attn} for this KV-cache scale")
                    modules[attn].load_kv_scale(which, as_tensor(tensor))
                continue
            if self.quant_config is not None and self.quant_config.skip_tensor(full_name):
                continue
            module_name, _, param_name = name.rpartition(".")
            parent, _, leaf = module_name.rpartition(".")
            if leaf in self._STACKED:
                merged, shard = self._STACKED[leaf]
                target = f"{parent}.{merged}"
            else:
                target, shard = module_name, None
            module = modules.get(target)
            if isinstance(module, Linear):
                try:
                    module.load(param_name, tensor, shard)
                except ValueError as e:
                    raise ValueError(f"checkpoint tensor {full_name!r}: {e}") from None
                if param_name == "bias" and getattr(module, "output_bias", None) is not None:
                    param_name = "output_bias"  # a row-parallel bias, added after the all-reduce
                loaded.add(f"{target}.{param_name}")
            elif isinstance(module, VocabParallelEmbedding):
                module.load(param_name, tensor)
                loaded.add(name)
            elif name in params:
                param = params[name]
                tensor = as_tensor(tensor)
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}")
                param.data.copy_(tensor)
                loaded.add(name)
            else:
                raise ValueError(f"checkpoint tensor {full_name!r} matches no parameter of the model "
                                 f"({type(self).__name__}); refusing to drop it silently")
        return loaded


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias_default = True
