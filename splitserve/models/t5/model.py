"""T5 / Flan-T5 (`T5ForConditionalGeneration`): an encoder-decoder on the split.

- The **encoder** runs once per request, when its first step comes (worker/encoder_decoder.py): all
  encoders of a step in one padded batch (bidirectional attention with T5's relative position
  buckets, each sequence masked to its own length), then every decoder layer projects the encoder
  output to its cross K/V, which are stored once in the request's cross blocks. It also takes input
  embeddings (`encode_embeds`), so a vision front (BLIP-2's Q-Former) can feed it.
- The **decoder** runs on the flat token stream like every decoder of the engine: per layer the
  self-attention op (paged KV, causal, with the relative position bias as a per-head table over
  query-key distances, `Attention.pos_bias`), then the cross-attention op (attention/cross.py) over the
  request's encoder K/V, then the feed-forward (ReLU, or gated-GELU for v1.1 / Flan-T5).

Every parameter layer is one of splitserve/layers' parallel linear layers, so a quantization
method (`--quantization fp8`, or a quantized checkpoint's) and tensor parallelism apply as in the
decoder-only models: q/k/v merged into one column-parallel projection (cross-attention: q apart, k/v
merged, as they run on different inputs), o and wo row-parallel, wi (wi_0/wi_1 merged) column-
parallel, the shared embedding and the LM head split by vocabulary rows. A rank keeps its heads
everywhere: its q/k/v columns, its columns of the relative attention bias table, its part of the
KV cache and of the cross blocks.

T5 specifics kept as transformers computes them: the RMS-style T5LayerNorm (no mean, no bias; fp32
variance), unscaled attention logits (scale 1; the init absorbs it), the bias computed by the first
layer and shared by all, and (original T5, not v1.1 / Flan) the decoder output scaled by d_model ** -0.5
before the LM head. Module names follow the checkpoint's except where layers are merged; each module
that merges says which checkpoint children it holds (`ckpt_children`, read by `load_named`).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.attention.cross import CrossAttention
from splitserve.attention.layer import Attention
from splitserve.layers.cpu_gemm import linear
from splitserve.layers.linear import Linear
from splitserve.layers.parallel_linear import (ColumnParallelLinear, MergedColumnParallelLinear, ParallelLMHead,
                                               QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                               divide)
from splitserve.layers.quantization.base import QuantConfig, copy_checkpoint_tensor, method_for
from splitserve.parallel.communication import tp_all_gather
from splitserve.parallel.parallel_state import tp_group

_ACTIVATIONS = {"relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "silu": F.silu}


def relative_position_bucket(relative_position: torch.Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """T5's bucket of key position - query position: exact for small distances, logarithmic up to
    max_distance, and (bidirectional) separate buckets for keys after the query."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    large = max_exact + (torch.log(distance.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).long()
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, large)


class T5LayerNorm(nn.Module):
    """x / rms(x) * weight, the mean square in fp32 (T5 has no mean subtraction and no bias)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + self.eps)).to(self.weight.dtype)


class RelativeBias(nn.Module):
    """The relative attention bias table [buckets, heads], this rank's heads only: its columns
    [first, first + heads), the heads its q/k/v hold (the bias is added per head to their logits)."""

    def __init__(self, num_buckets: int, num_heads: int):
        super().__init__()
        g = tp_group()
        self.heads = divide(num_heads, g.world_size, "attention heads")
        self.first = g.rank * self.heads
        self.weight = nn.Parameter(torch.empty(num_buckets, self.heads), requires_grad=False)

    def forward(self, buckets: torch.Tensor) -> torch.Tensor:
        return F.embedding(buckets, self.weight)

    def load_checkpoint(self, param: str, tensor) -> str:
        if param != "weight":
            raise ValueError(f"no parameter {param!r} in the relative attention bias")
        copy_checkpoint_tensor(self.weight, tensor.narrow(1, self.first, self.heads), "relative_attention_bias")
        return "weight"


class T5Attention(nn.Module):
    """One T5-style attention's projections (no biases), this rank's heads. `names`: the checkpoint's
    names of q, k, v, o (T5: q k v o; Pix2Struct: query key value output). Self-attention merges
    q/k/v (`qkv_proj`); cross-attention keeps `q_proj` (the decoder's tokens) apart from `kv_proj`
    (the encoder output, projected once per request). `method`: the quantization method of the
    layer standing for the checkpoint modules given (relative names)."""

    def __init__(self, hidden: int, num_heads: int, head_dim: int, method: Callable[..., object],
                 names: tuple[str, str, str, str] = ("q", "k", "v", "o"), cross: bool = False,
                 num_buckets: int | None = None):
        super().__init__()
        q, k, v, o = names
        inner = num_heads * head_dim
        self.head_dim = head_dim
        if cross:
            self.q_proj = ColumnParallelLinear(hidden, inner, method=method(q))
            self.kv_proj = MergedColumnParallelLinear(hidden, {k: inner, v: inner}, method=method(k, v))
            self.ckpt_children = {q: ("q_proj", None), k: ("kv_proj", k), v: ("kv_proj", v)}
            self.num_heads = self.q_proj.out_features // head_dim
        else:
            self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_heads, method=method(q, k, v))
            self.ckpt_children = {q: ("qkv_proj", "q"), k: ("qkv_proj", "k"), v: ("qkv_proj", "v")}
            self.num_heads = self.qkv_proj.num_heads
        self.o_proj = RowParallelLinear(inner, hidden, method=method(o))
        self.ckpt_children[o] = ("o_proj", None)
        if num_buckets is not None:
            self.relative_attention_bias = RelativeBias(num_buckets, num_heads)

    def qkv(self, x: torch.Tensor) -> list[torch.Tensor]:
        return self.qkv_proj.split(self.qkv_proj(x))

    def kv(self, x: torch.Tensor) -> list[torch.Tensor]:
        return self.kv_proj.split(self.kv_proj(x))

    def bidirectional(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """The encoder's attention over a padded batch x [N, L, hidden], unscaled logits plus `bias`
        ([N or 1, heads, L, L], fp32: relative positions and/or the padding mask)."""
        N, L, _ = x.shape
        q, k, v = (t.view(N, L, self.num_heads, self.head_dim).transpose(1, 2) for t in self.qkv(x))
        attn = torch.softmax((q @ k.transpose(-1, -2)).float() + bias, dim=-1).to(v.dtype) @ v
        return self.o_proj(attn.transpose(1, 2).reshape(N, L, self.num_heads * self.head_dim))


class T5MLP(nn.Module):
    """wo(act(wi(x))), or gated wo(act(wi_0(x)) * wi_1(x)) with wi_0/wi_1 merged into `wi`."""

    def __init__(self, hidden: int, d_ff: int, act: str, gated: bool, method: Callable[..., object]):
        super().__init__()
        if act not in _ACTIVATIONS:
            raise ValueError(f"T5 dense_act_fn {act!r} is not supported; known: {sorted(_ACTIVATIONS)}")
        self.act, self.gated = _ACTIVATIONS[act], gated
        if gated:
            self.wi = MergedColumnParallelLinear(hidden, {"wi_0": d_ff, "wi_1": d_ff}, method=method("wi_0", "wi_1"))
            self.ckpt_children = {"wi_0": ("wi", "wi_0"), "wi_1": ("wi", "wi_1")}
        else:
            self.wi = ColumnParallelLinear(hidden, d_ff, method=method("wi"))
        self.wo = RowParallelLinear(d_ff, hidden, method=method("wo"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wi(x)
        if self.gated:
            gate, up = self.wi.split(h)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        return self.wo(h)


def methods(quant_config: QuantConfig | None, ckpt: str) -> Callable[..., object]:
    """method(*children): the quantization method of a layer standing for the checkpoint modules
    ckpt + child (the quantization config matches them by name: ignore lists, per-layer schemes)."""
    return lambda *children: method_for(quant_config, *(ckpt + c for c in children))


class _Sublayer(nn.Module):
    """One of a T5 block's residual sublayers: its pre-norm and its body (named as in checkpoints)."""

    def __init__(self, config, body_name: str, body: nn.Module):
        super().__init__()
        self.layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon)
        setattr(self, body_name, body)


class _Block(nn.Module):
    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layer = nn.ModuleList(layers)


class T5Stack(nn.Module):
    def __init__(self, config, num_layers: int, decoder: bool, quant_config: QuantConfig | None, ckpt: str):
        super().__init__()
        c = config
        blocks = []
        for i in range(num_layers):
            at = f"{ckpt}block.{i}.layer."
            self_attn = T5Attention(c.d_model, c.num_heads, c.d_kv, methods(quant_config, f"{at}0.SelfAttention."),
                                    num_buckets=c.relative_attention_num_buckets if i == 0 else None)
            layers = [_Sublayer(c, "SelfAttention", self_attn)]
            if decoder:
                layers.append(_Sublayer(c, "EncDecAttention", T5Attention(
                    c.d_model, c.num_heads, c.d_kv, methods(quant_config, f"{at}1.EncDecAttention."), cross=True)))
            ff = T5MLP(c.d_model, c.d_ff, c.dense_act_fn, c.is_gated_act,
                       methods(quant_config, f"{at}{len(layers)}.DenseReluDense."))
            layers.append(_Sublayer(c, "DenseReluDense", ff))
            blocks.append(_Block(layers))
        self.block = nn.ModuleList(blocks)
        self.final_layer_norm = T5LayerNorm(c.d_model, c.layer_norm_epsilon)


def tp_logits(hidden: torch.Tensor, embedding: VocabParallelEmbedding, head: ParallelLMHead | None,
              vocab_size: int, out: torch.Tensor | None) -> torch.Tensor:
    """Logits from the LM head, or from the (vocabulary-parallel) embedding when the head is tied:
    with tensor parallelism each rank computes its vocabulary rows and all gather them."""
    if tp_group().world_size > 1:
        local = linear(hidden, embedding.weight) if head is None else head(hidden)
        logits = tp_all_gather(local)[..., :vocab_size]
    elif head is not None and head.is_quantized:  # a format that quantizes the head
        logits = head(hidden)
    else:
        weight = embedding.weight if head is None else head.weight
        return F.linear(hidden, weight) if out is None else torch.mm(hidden, weight.t(), out=out)
    return logits if out is None else out.copy_(logits)


def load_named(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], what: str) -> set[str]:
    """Checkpoint tensors onto `model` by name; returns the parameters filled. A parameter layer
    (Linear, the vocabulary-parallel embedding, a module with `load_checkpoint`) takes its tensors
    itself: its rank's part, read lazily, and its quantization method's own tensors (scales). A
    checkpoint child that a module merged into one layer is routed by the module's `ckpt_children`
    (child -> (layer, shard)). The rest (norms, replicated tables) is copied whole. A tensor that
    matches nothing is an error naming it: a silently dropped tensor is a wrong model."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        module_name, _, param = name.rpartition(".")
        shard = None
        if module_name not in modules:
            modules = dict(model.named_modules())  # a layer the loading itself added (T5's own head)
        if module_name not in modules:
            parent, _, child = module_name.rpartition(".")
            route = getattr(modules.get(parent), "ckpt_children", {}).get(child)
            if route is None:
                raise ValueError(f"unexpected {what} checkpoint tensor {name!r}")
            module_name, shard = f"{parent}.{route[0]}" if parent else route[0], route[1]
        module = modules[module_name]
        try:
            if isinstance(module, Linear):
                module.load(param, tensor, shard)
                if param == "bias" and getattr(module, "output_bias", None) is not None:
                    param = "output_bias"  # a row-parallel bias, added after the all-reduce
            elif isinstance(module, VocabParallelEmbedding):
                module.load(param, tensor)
            elif hasattr(module, "load_checkpoint"):
                param = module.load_checkpoint(param, tensor)
            elif f"{module_name}.{param}" in params:
                copy_checkpoint_tensor(params[f"{module_name}.{param}"], tensor, name)
            else:
                raise ValueError("it matches no parameter")
        except ValueError as e:
            raise ValueError(f"{what} checkpoint tensor {name!r}: {e}") from None
        loaded.add(f"{module_name}.{param}")
    return loaded


class T5ForConditionalGeneration(nn.Module):
    is_encoder_decoder = True

    def __init__(self, config, quant_config: QuantConfig | None = None, prefix: str = ""):
        """prefix: the checkpoint's name of this model ("language_model." in BLIP-2), by which a
        quantization config picks each layer's method."""
        super().__init__()
        self.config, self.quant_config, self.prefix = config, quant_config, prefix
        self.num_heads, self.head_dim, self.d_model = config.num_heads, config.d_kv, config.d_model
        # Original T5 scales the decoder output by d_model ** -0.5 before the head, v1.1 / Flan-T5 do
        # not: transformers 5 says so in scale_decoder_outputs (older configs: tie_word_embeddings).
        scale = getattr(config, "scale_decoder_outputs", None)
        self.scale_outputs = bool(getattr(config, "tie_word_embeddings", True) if scale is None else scale)
        self.vocab_size = config.vocab_size
        self.shared = VocabParallelEmbedding(config.vocab_size, config.d_model)
        self.encoder = T5Stack(config, config.num_layers, False, quant_config, f"{prefix}encoder.")
        num_decoder_layers = getattr(config, "num_decoder_layers", None) or config.num_layers
        self.decoder = T5Stack(config, num_decoder_layers, True, quant_config, f"{prefix}decoder.")
        # The head is `shared` unless the checkpoint has its own lm_head.weight (Flan-T5's own files;
        # transformers 5 writes every T5 config as tied, so the config cannot say): load_weights then
        # adds it. As for the decoder-only models, online FP8 leaves the head in float.
        self.lm_head: ParallelLMHead | None = None
        # The batchless ops of each decoder layer: self-attention (layer i's paged KV) and
        # cross-attention (the same tensor's cross blocks), over this rank's heads. T5 does not
        # scale its logits.
        heads = self.decoder.block[0].layer[0].SelfAttention.num_heads
        self.self_attn = nn.ModuleList(Attention(i, heads, heads, self.head_dim, 1.0)
                                       for i in range(num_decoder_layers))
        self.cross_attn = nn.ModuleList(CrossAttention(i, heads, heads, self.head_dim, 1.0)
                                        for i in range(num_decoder_layers))
        self._bias_ready = False

    # -- encoder ---------------------------------------------------------------------------------------
    def _bias(self, stack: T5Stack, q_pos: torch.Tensor, k_pos: torch.Tensor, bidirectional: bool) -> torch.Tensor:
        """[H, Q, K] relative position bias of the stack's first layer (shared by all its layers), this
        rank's heads."""
        c = self.config
        buckets = relative_position_bucket(k_pos[None, :] - q_pos[:, None], bidirectional,
                                           c.relative_attention_num_buckets, c.relative_attention_max_distance)
        return stack.block[0].layer[0].SelfAttention.relative_attention_bias(buckets).permute(2, 0, 1)

    def encode(self, inputs: list[tuple[list[int], int, tuple]]) -> torch.Tensor:
        """Encoder outputs of a step's requests, [sum of lengths, d_model] in order; each input is
        (encoder token ids, their count, images: unused by T5)."""
        device = self.shared.weight.device
        return self.encode_embeds([self.shared(torch.tensor(ids, dtype=torch.long, device=device))
                                   for ids, _, _ in inputs])

    def encode_embeds(self, embeds: list[torch.Tensor]) -> torch.Tensor:
        """The encoder over input embeddings ([L_i, d_model] each): one padded batch, each sequence
        attending over its own positions only. Returns the valid rows, flat."""
        lens = [e.shape[0] for e in embeds]
        L = max(lens)
        device = embeds[0].device
        x = torch.nn.utils.rnn.pad_sequence(embeds, batch_first=True)  # [N, L, d]
        pos = torch.arange(L, device=device)
        valid = pos[None, :] < torch.tensor(lens, device=device)[:, None]  # [N, L]
        bias = self._bias(self.encoder, pos, pos, bidirectional=True)[None].float()  # [1, H, L, L]
        bias = bias.masked_fill(~valid[:, None, None, :], torch.finfo(torch.float32).min)
        for block in self.encoder.block:
            sub = block.layer[0]
            x = x + sub.SelfAttention.bidirectional(sub.layer_norm(x), bias)
            ff = block.layer[1]
            x = x + ff.DenseReluDense(ff.layer_norm(x))
        x = self.encoder.final_layer_norm(x)
        return x[valid]

    def store_cross_kv(self, hidden: torch.Tensor, slots: torch.Tensor, backend) -> None:
        """Projects encoder outputs [E, d_model] to every decoder layer's cross K/V (this rank's
        heads), stored at `slots`."""
        for block, cross in zip(self.decoder.block, self.cross_attn):
            k, v = block.layer[1].EncDecAttention.kv(hidden)
            cross.store(k, v, slots, backend)

    # -- decoder (the flat token stream) ---------------------------------------------------------------
    def _ensure_bias_table(self) -> None:
        """Tabulates the decoder's self-attention bias over query-key distances 0..max once (after the
        weights are in), for the attention backends: pos_bias[h, d] (this rank's heads)."""
        if self._bias_ready:
            return
        max_len = int(getattr(self.config, "max_position_embeddings", None) or 2048) + 1
        d = torch.arange(max_len, device=self.shared.weight.device)
        table = self._bias(self.decoder, d, torch.zeros_like(d[:1]), bidirectional=False)[:, :, 0].float().contiguous()
        for attn in self.self_attn:
            attn.pos_bias = table
        self._bias_ready = True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        self._ensure_bias_table()
        x = self.shared(input_ids) if inputs_embeds is None else inputs_embeds
        for block, attn, cross in zip(self.decoder.block, self.self_attn, self.cross_attn):
            sub = block.layer[0]
            p = sub.SelfAttention
            x = x + p.o_proj(attn(*p.qkv(sub.layer_norm(x)), positions))
            sub = block.layer[1]
            p = sub.EncDecAttention
            x = x + p.o_proj(cross(p.q_proj(sub.layer_norm(x))))
            sub = block.layer[2]
            x = x + sub.DenseReluDense(sub.layer_norm(x))
        return self.decoder.final_layer_norm(x)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.scale_outputs:
            hidden = hidden * self.d_model ** -0.5
        return tp_logits(hidden, self.shared, self.lm_head, self.vocab_size, out)

    def _add_lm_head(self) -> None:
        """The checkpoint's own head, built like the model's other layers (its device and dtype)."""
        w = self.shared.weight
        prev = torch.get_default_dtype()
        torch.set_default_dtype(w.dtype)
        try:
            with torch.device(w.device):
                self.lm_head = ParallelLMHead(self.d_model, self.vocab_size,
                                              method=method_for(self.quant_config, f"{self.prefix}lm_head"))
        finally:
            torch.set_default_dtype(prev)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def wanted():
            for name, tensor in weights:
                if name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
                    continue  # tied to `shared`
                if name == "lm_head.weight" and self.lm_head is None:
                    self._add_lm_head()
                if self.quant_config is not None and self.quant_config.skip_tensor(self.prefix + name):
                    continue
                yield name, tensor
        loaded = load_named(self, wanted(), "T5")
        self._bias_ready = False
        return loaded
