"""The one configurable decoder on the flat token stream: every dense and MoE text family.

Every layer here is batchful: it sees [num_tokens, hidden] with the tokens of all requests of the step
concatenated. Only `Attention` (the custom op) knows which token belongs to which sequence.

What differs between families is read once, at build time, from a `DecoderSpec` (models/families.py):
which norm, where the norms sit, which MLP and activation, q/k norms, biases, scales, multipliers and
soft caps. The choices are Python attributes fixed when the module is built, so the compiled layer
halves specialise on them once, and a Llama config runs exactly the ops it ran before the families
(no multiply by 1, no extra norm).
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.attention.cross import CrossAttention
from splitserve.attention.layer import Attention
from splitserve.parallel.communication import Intermediate, tp_all_gather
from splitserve.parallel.parallel_state import pp_group, stage_layers, tp_group
from splitserve.layers.activation import activation, gated_activation, silu_and_mul
from splitserve.layers.cpu_gemm import linear
from splitserve.layers.linear import Linear
from splitserve.layers.norm import GemmaRMSNorm, LayerNorm, LayerNorm1P, RMSNorm
from splitserve.layers.parallel_linear import (ColumnParallelLinear, MergedColumnParallelLinear, ParallelLMHead,
                                               QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                               local_heads)
from splitserve.layers.quantization.base import QuantConfig, method_for
from splitserve.layers.rotary import RotaryEmbedding
from splitserve.models.families import DecoderSpec, decoder_spec

_NORMS = {"rms": RMSNorm, "gemma_rms": GemmaRMSNorm, "layer": LayerNorm, "layer1p": LayerNorm1P}


def make_norm(spec: DecoderSpec) -> nn.Module:
    return _NORMS[spec.family.norm](spec.hidden_size, spec.norm_eps)


class HeadNorm(nn.Module):
    """q/k norm over each head's head_dim features, on [T, heads * head_dim]: one RMSNorm (Qwen3)
    or LayerNorm (Persimmon) shared by the heads, or a LayerNorm without bias per head (StableLM;
    this rank's heads first_head.. first_head + num_heads)."""

    def __init__(self, kind: str, num_heads: int, head_dim: int, eps: float, first_head: int = 0):
        super().__init__()
        self.kind, self.num_heads, self.head_dim, self.first_head = kind, num_heads, head_dim, first_head
        if kind == "rms":
            self.norm = RMSNorm(head_dim, eps)
        elif kind == "layer":
            self.norm = LayerNorm(head_dim, eps)
        elif kind == "layer_per_head":
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(num_heads, head_dim), requires_grad=False)
        else:
            raise ValueError(f"unknown q/k norm {kind!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = x.unflatten(-1, (self.num_heads, self.head_dim))
        if self.kind == "layer_per_head":
            out = F.layer_norm(heads, (self.head_dim,), None, None, self.eps) * self.weight
        else:
            out = self.norm(heads)
        return out.flatten(-2)

    def load_checkpoint(self, param: str, tensor: torch.Tensor) -> str:
        """A checkpoint tensor relative to this module (`weight`, `bias`, or StableLM's
        `norms.{h}.weight`); returns the parameter it filled."""
        if self.kind != "layer_per_head":
            target = getattr(self.norm, param, None)
            if not isinstance(target, nn.Parameter) or target.shape != tensor.shape:
                raise ValueError(f"q/k norm has no parameter {param!r} of shape {tuple(tensor.shape)}")
            target.data.copy_(tensor)
            return f"norm.{param}"
        parts = param.split(".")
        if len(parts) != 3 or parts[0] != "norms" or parts[2] != "weight" or not parts[1].isdigit():
            raise ValueError(f"per-head norm has no parameter {param!r}")
        head = int(parts[1]) - self.first_head
        if 0 <= head < self.num_heads:
            self.weight.data[head].copy_(tensor)
        return "weight"


class DecoderAttention(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_idx: int, model_layer: int, rotary: RotaryEmbedding | None,
                 quant_config: QuantConfig | None, ckpt: str):
        """layer_idx: the stage's index of the layer (its KV cache); model_layer: the model's (the
        checkpoint's and the config's per-layer settings). ckpt: the layer's checkpoint prefix."""
        super().__init__()
        names = spec.family.names
        self.head_dim = spec.head_dim
        H, nh, nkv, hd = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
        # This tensor-parallel rank's heads (all of them on one device).
        self.qkv_proj = QKVParallelLinear(H, hd, nh, nkv, bias=spec.qkv_bias, method=method_for(
            quant_config, *(ckpt + n for n in names.checkpoint_modules("self_attn.qkv_proj"))))
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(nh * hd, H, bias=spec.o_bias, method=method_for(
            quant_config, *(ckpt + n for n in names.checkpoint_modules("self_attn.o_proj"))))
        if spec.qk_norm is not None:
            g = tp_group()
            _, _, kv_part = local_heads(nh, nkv, g.rank, g.world_size)
            self.q_norm = HeadNorm(spec.qk_norm, self.num_heads, hd, spec.norm_eps, g.rank * self.num_heads)
            self.k_norm = HeadNorm(spec.qk_norm, self.num_kv_heads, hd, spec.norm_eps, kv_part * self.num_kv_heads)
        else:
            self.q_norm = self.k_norm = None
        # Kosmos-2 normalises the attention output over all heads before o_proj: one rank needs them all.
        self.inner_attn_ln = LayerNorm(nh * hd, spec.norm_eps) if spec.family.inner_attn_norm else None
        if self.inner_attn_ln is not None and tp_group().world_size > 1:
            raise ValueError(f"{spec.model_type}: tensor parallelism is not supported with a norm inside attention")
        # The rotary table (one for all layers) goes to the attention op, which rotates q and k
        # where it stores the cache (one pass over them instead of two).
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, hd, spec.scale, rotary,
                              sliding_window=spec.windows[model_layer], soft_cap=spec.attn_soft_cap)

    def qkv(self, x: torch.Tensor):
        """The attention op's inputs: q [T, Hq * D], k and v [T, Hkv * D], views of one projection
        (q and k normalised per head first where the family does)."""
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up as one merged projection."""

    def __init__(self, spec: DecoderSpec, intermediate: int, quant_config, ckpt: str):
        super().__init__()
        names = spec.family.names
        self.gate_up_proj = MergedColumnParallelLinear(
            spec.hidden_size, {"gate": intermediate, "up": intermediate}, bias=spec.mlp_bias,
            method=method_for(quant_config, *(ckpt + n for n in names.checkpoint_modules("mlp.gate_up_proj"))))
        self.down_proj = RowParallelLinear(intermediate, spec.hidden_size, bias=spec.mlp_bias, method=method_for(
            quant_config, *(ckpt + n for n in names.checkpoint_modules("mlp.down_proj"))))
        self.act_and_mul = gated_activation(spec.activation)
        self.silu = self.act_and_mul is silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        # SiLU goes to the down projection with gate_up, so that a method which quantizes its input
        # (FP8, INT8) fuses silu·mul into that quantization. A LoRA wrapper (not a Linear) needs the
        # activations themselves for its delta and keeps the separate activation.
        if self.silu and isinstance(self.down_proj, Linear):
            return self.down_proj.forward_silu_mul(gate_up)
        return self.down_proj(self.act_and_mul(gate_up))


class PlainMLP(nn.Module):
    """down(act(up(x))): OPT's fc1/fc2, Persimmon's dense_h_to_4h/dense_4h_to_h."""

    def __init__(self, spec: DecoderSpec, quant_config, ckpt: str):
        super().__init__()
        names, I = spec.family.names, spec.intermediate_size
        self.up_proj = ColumnParallelLinear(spec.hidden_size, I, bias=spec.mlp_bias, method=method_for(
            quant_config, *(ckpt + n for n in names.checkpoint_modules("mlp.up_proj"))))
        self.down_proj = RowParallelLinear(I, spec.hidden_size, bias=spec.mlp_bias, method=method_for(
            quant_config, *(ckpt + n for n in names.checkpoint_modules("mlp.down_proj"))))
        self.act = activation(spec.activation)
        # Kosmos-2 normalises the activations over the whole intermediate width: one rank needs them all.
        self.ffn_layernorm = LayerNorm(I, spec.norm_eps) if spec.family.mlp_norm else None
        if self.ffn_layernorm is not None and tp_group().world_size > 1:
            raise ValueError(f"{spec.model_type}: tensor parallelism is not supported with a norm inside the MLP")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.up_proj(x))
        if self.ffn_layernorm is not None:
            h = self.ffn_layernorm(h)
        return self.down_proj(h)


class DecoderCrossAttention(nn.Module):
    """The decoder of an encoder-decoder model (mBART in Nougat): each layer's attention over its
    request's encoder output, a pre-norm residual block between self-attention and MLP. kv_proj maps
    the encoder output once per request (`store`, when the encoder runs) into the cross blocks of the
    layer's cache; the step's queries go through the cross-attention op. Its heads and head size are
    the self-attention's: the two groups share the layer's cache tensor."""

    def __init__(self, spec: DecoderSpec, layer_idx: int, num_heads: int, num_kv_heads: int,
                 quant_config: QuantConfig | None, ckpt: str):
        super().__init__()
        names = spec.family.names
        H, hd = spec.hidden_size, spec.head_dim

        def method(module: str):
            return method_for(quant_config, *(ckpt + n for n in names.checkpoint_modules(module)))
        self.norm = make_norm(spec)
        self.q_proj = ColumnParallelLinear(H, spec.num_heads * hd, bias=spec.qkv_bias, method=method("cross_attn.q_proj"))
        kv = spec.num_kv_heads * hd
        self.kv_proj = MergedColumnParallelLinear(H, {"k": kv, "v": kv}, bias=spec.qkv_bias,
                                                  method=method("cross_attn.kv_proj"))
        self.o_proj = RowParallelLinear(spec.num_heads * hd, H, bias=spec.o_bias, method=method("cross_attn.o_proj"))
        self.attn = CrossAttention(layer_idx, num_heads, num_kv_heads, hd, spec.scale)

    def store(self, encoder_out: torch.Tensor, slots: torch.Tensor, backend) -> None:
        """Projects a step's encoder outputs [E, hidden] to K/V and stores them at their cross slots."""
        k, v = self.kv_proj.split(self.kv_proj(encoder_out))
        self.attn.store(k, v, slots, backend)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.norm(x, residual)
        return self.o_proj(self.attn(self.q_proj(h))), residual


def make_mlp(spec: DecoderSpec, model_layer: int, quant_config, ckpt: str) -> nn.Module:
    moe = spec.moe
    if moe is not None and model_layer not in moe.dense_layers:
        from splitserve.layers.moe.layer import FusedMoE
        if tp_group().world_size > 1:
            raise ValueError(f"{spec.model_type}: tensor parallelism is not supported for mixture-of-experts "
                             f"layers yet; run it with tensor_parallel_size 1")
        if spec.activation != "silu":
            raise ValueError(f"{spec.model_type}: the fused MoE layer computes SiLU experts, not {spec.activation!r}")
        return FusedMoE(moe.num_experts, moe.top_k, spec.hidden_size, moe.intermediate_size,
                        renormalize=moe.renormalize, shared_expert_intermediate_size=moe.shared_intermediate_size)
    if spec.family.mlp == "plain":
        return PlainMLP(spec, quant_config, ckpt)
    return GatedMLP(spec, spec.intermediate_size, quant_config, ckpt)


def start_residual(x: torch.Tensor) -> torch.Tensor:
    """The residual stream before the first layer: zeros, so that layer 0's norm(x + residual) is
    exactly norm(x) and every layer runs the same code."""
    return torch.zeros_like(x)


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding | None,
                 quant_config: QuantConfig | None = None, prefix: str = "", model_layer: int | None = None):
        """layer_idx: the layer's index among this pipeline stage's layers (its KV cache's index);
        model_layer: its index in the whole model (None: the same). prefix: its checkpoint name
        with a trailing dot ("model.layers.3."), by which a quantization config picks methods."""
        super().__init__()
        model_layer = layer_idx if model_layer is None else model_layer
        self.self_attn = DecoderAttention(spec, layer_idx, model_layer, rotary, quant_config, prefix)
        self.mlp = make_mlp(spec, model_layer, quant_config, prefix)
        self.input_layernorm = make_norm(spec)
        self.post_attention_layernorm = make_norm(spec)
        self.sandwich = spec.family.sandwich
        if self.sandwich:  # Gemma 2: post_attention_layernorm normalises the attention output instead
            self.pre_feedforward_layernorm = make_norm(spec)
            self.post_feedforward_layernorm = make_norm(spec)
        self.residual_multiplier = spec.residual_multiplier
        self.cross_attn = (DecoderCrossAttention(spec, layer_idx, self.self_attn.num_heads, self.self_attn.num_kv_heads,
                                                 quant_config, prefix) if spec.cross_attention else None)

    # The layer in two batchful halves around the batchless attention op. Compiled (and, for
    # piecewise CUDA graphs, captured) separately; forward is just the two with the op between.
    # The residual is always a tensor (zeros before the first layer, see start_residual): one compiled
    # graph per half, where a None there would make dynamo compile a second one for layer 0.
    def attn_inputs(self, x, residual):
        x, residual = self.input_layernorm(x, residual)
        q, k, v = self.self_attn.qkv(x)
        return q, k, v, residual

    def attn_outputs(self, attn_out, residual):
        if self.self_attn.inner_attn_ln is not None:
            attn_out = self.self_attn.inner_attn_ln(attn_out)
        x = self.self_attn.o_proj(attn_out)
        if self.cross_attn is not None:  # encoder-decoder models: over the encoder output before the MLP
            x, residual = self.cross_attn(x, residual)
        if self.sandwich:
            x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
            return self.post_feedforward_layernorm(self.mlp(x)), residual
        if self.residual_multiplier is not None:
            x = x * self.residual_multiplier
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        if self.residual_multiplier is not None:
            x = x * self.residual_multiplier
        return x, residual

    def forward(self, positions, x, residual):
        q, k, v, residual = self.attn_inputs(x, residual)
        return self.attn_outputs(self.self_attn.attn(q, k, v, positions), residual)


class LearnedPositions(nn.Module):
    """OPT's absolute position embedding: row position + offset of a learned table (replicated)."""

    def __init__(self, max_position: int, hidden: int, offset: int):
        super().__init__()
        self.offset = offset
        self.weight = nn.Parameter(torch.empty(max_position + offset, hidden), requires_grad=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions + self.offset, self.weight)


class SinusoidalPositions(nn.Module):
    """Kosmos-2's fixed position table (fairseq's): row p + offset holds [sin(p w), cos(p w)] with
    w_i = 10000^(-i / (dim/2 - 1)); offset = pad_token_id + 1. Computed, never loaded."""

    def __init__(self, max_position: int, dim: int, offset: int):
        super().__init__()
        self.offset = offset
        half = dim // 2
        freqs = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000) / (half - 1)))
        angles = torch.arange(max_position + offset, dtype=torch.float32)[:, None] * freqs[None]
        table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
        if dim % 2:
            table = torch.cat([table, torch.zeros(table.shape[0], 1)], dim=1)
        self.register_buffer("table", table.to(torch.get_default_dtype()), persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions + self.offset, self.table)


class DecoderForCausalLM(nn.Module):
    """The decoder, or this rank's part of it: the tensor-parallel group (parallel_state.tp_group())
    splits every layer's heads and features; the pipeline group (pp_group()) gives each stage a
    contiguous run of layers (stage_layers), the first stage the embedding and the last the final
    norm and the LM head. `forward` of a stage that is not the last returns an Intermediate
    (hidden, residual) that the next stage's forward takes as `intermediate`."""

    def __init__(self, config, quant_config: QuantConfig | None = None, prefix: str = "model",
                 head_name: str = "lm_head", cross_attention: bool = False):
        """`prefix` / `head_name`: the checkpoint's module names of the decoder and the LM head, by
        which a quantization config picks each layer's method (VLMs nest the decoder deeper).
        cross_attention: the decoder of an encoder-decoder model (each layer's `cross_attn`)."""
        super().__init__()
        self.config = config
        self.spec = spec = decoder_spec(config, cross_attention)
        self.quant_config = quant_config
        pp = pp_group()
        self.tp_size = tp_group().world_size
        self.is_first_stage, self.is_last_stage = pp.is_first, pp.is_last
        self.start_layer, self.end_layer = stage_layers(spec.num_layers, pp.rank, pp.world_size)
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size) if pp.is_first else None
        offset = spec.family.learned_positions
        self.embed_positions = (LearnedPositions(spec.max_position, spec.hidden_size, offset)
                                if pp.is_first and offset is not None else None)
        if pp.is_first and spec.family.sinusoidal_positions:
            self.embed_positions = SinusoidalPositions(spec.max_position, spec.hidden_size, spec.position_offset)
        self.embed_norm = make_norm(spec) if pp.is_first and spec.family.embed_norm else None
        # Gemma multiplies the embedding by sqrt(hidden) rounded to the model's dtype first.
        self.embed_scale = (None if spec.embed_scale is None
                            else float(torch.tensor(spec.embed_scale, dtype=torch.get_default_dtype(), device="cpu")))
        self.embedding_multiplier = spec.embedding_multiplier
        rotary = None if spec.rope is None else RotaryEmbedding(spec.head_dim, spec.max_position, spec.rope)
        # Layer i of the checkpoint is this stage's layer i - start_layer (its KV cache's index).
        ckpt = f"{prefix}.{spec.family.names.inner}layers"
        self.layers = nn.ModuleList(
            DecoderLayer(spec, i - self.start_layer, rotary, quant_config, f"{ckpt}.{i}.", i)
            for i in range(self.start_layer, self.end_layer))
        self.norm = make_norm(spec) if pp.is_last else None
        self.tie_word_embeddings = spec.tie_word_embeddings
        # A tied head is the embedding; a last stage without the embedding loads its own copy of it.
        self.head_from_embedding = self.tie_word_embeddings and pp.is_last and not pp.is_first
        if not pp.is_last or (self.tie_word_embeddings and pp.is_first):
            self.lm_head = None
        else:
            method = None if self.head_from_embedding else method_for(quant_config, head_name)
            self.lm_head = ParallelLMHead(spec.hidden_size, spec.vocab_size, method=method)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (a VLM puts its image features among them before `start`)."""
        x = self.embed_tokens(input_ids)
        return x if self.embed_scale is None else x * self.embed_scale

    def start(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream entering layer 0 and its residual, from the input embeddings."""
        if self.embedding_multiplier is not None:
            x = x * self.embedding_multiplier
        if self.embed_positions is not None:
            x = x + self.embed_positions(positions)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        return x, start_residual(x)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None,
                intermediate: Intermediate | None = None) -> torch.Tensor | Intermediate:
        """[T] token ids and positions -> [T, hidden] final hidden states (the last pipeline stage),
        or the Intermediate stream for the next stage. Stages after the first start from
        `intermediate` (the previous stage's output) and ignore input_ids / inputs_embeds."""
        if self.is_first_stage:
            x, residual = self.start(self.embed(input_ids) if inputs_embeds is None else inputs_embeds, positions)
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
            logits = tp_all_gather(local)[..., :self.spec.vocab_size]
            logits = logits if out is None else out.copy_(logits)
        elif self.lm_head is not None and self.lm_head.is_quantized:  # a format that quantizes the head
            logits = self.lm_head(hidden)
            logits = logits if out is None else out.copy_(logits)
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = linear(hidden, weight) if out is None else torch.mm(hidden, weight.t(), out=out)
        spec = self.spec
        if spec.logits_scaling is not None:  # Granite
            logits.div_(spec.logits_scaling)
        if spec.final_soft_cap is not None:  # Gemma 2: cap * tanh(logits / cap)
            logits.div_(spec.final_soft_cap).tanh_().mul_(spec.final_soft_cap)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads HF-named tensors through the family's weight names (models/weights.py); returns the
        names of parameters that were filled."""
        from splitserve.models.weights import load_decoder_weights
        return load_decoder_weights(self, weights)


# The names the engine's other model code and older callers know the decoder by.
LlamaForCausalLM = DecoderForCausalLM
