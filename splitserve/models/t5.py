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

T5 specifics kept as transformers computes them: the RMS-style T5LayerNorm (no mean, no bias; fp32
variance), unscaled attention logits (scale 1; the init absorbs it), the bias computed by the first
layer and shared by all, and (original T5, not v1.1 / Flan) the decoder output scaled by d_model ** -0.5
before the LM head. Parameter names mirror the checkpoint's, so loading is a name-for-name copy.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.layers.quantization.base import as_tensor
from splitserve.attention.cross import CrossAttention
from splitserve.attention.layer import Attention

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
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + self.eps)).to(self.weight.dtype)


class T5Projections(nn.Module):
    """q, k, v, o of one attention (no biases); relative_attention_bias only in a stack's first layer."""

    def __init__(self, config, has_bias: bool):
        super().__init__()
        inner = config.num_heads * config.d_kv
        self.q = nn.Linear(config.d_model, inner, bias=False)
        self.k = nn.Linear(config.d_model, inner, bias=False)
        self.v = nn.Linear(config.d_model, inner, bias=False)
        self.o = nn.Linear(inner, config.d_model, bias=False)
        if has_bias:
            self.relative_attention_bias = nn.Embedding(config.relative_attention_num_buckets, config.num_heads)


class T5DenseActDense(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gated = config.is_gated_act
        if self.gated:
            self.wi_0 = nn.Linear(config.d_model, config.d_ff, bias=False)
            self.wi_1 = nn.Linear(config.d_model, config.d_ff, bias=False)
        else:
            self.wi = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)
        if config.dense_act_fn not in _ACTIVATIONS:
            raise ValueError(f"T5 dense_act_fn {config.dense_act_fn!r} is not supported; known: {sorted(_ACTIVATIONS)}")
        self.act = _ACTIVATIONS[config.dense_act_fn]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.wi_0(x)) * self.wi_1(x) if self.gated else self.act(self.wi(x))
        return self.wo(h)


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
    def __init__(self, config, num_layers: int, decoder: bool):
        super().__init__()
        blocks = []
        for i in range(num_layers):
            layers = [_Sublayer(config, "SelfAttention", T5Projections(config, has_bias=i == 0))]
            if decoder:
                layers.append(_Sublayer(config, "EncDecAttention", T5Projections(config, has_bias=False)))
            layers.append(_Sublayer(config, "DenseReluDense", T5DenseActDense(config)))
            blocks.append(_Block(layers))
        self.block = nn.ModuleList(blocks)
        self.final_layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon)


class T5ForConditionalGeneration(nn.Module):
    is_encoder_decoder = True

    def __init__(self, config, quant_config=None):
        super().__init__()
        if quant_config is not None:
            raise ValueError("quantized T5 checkpoints are not supported")
        self.config = config
        self.num_heads, self.head_dim, self.d_model = config.num_heads, config.d_kv, config.d_model
        # Original T5 scales the decoder output by d_model ** -0.5 before the head, v1.1 / Flan-T5 do
        # not: transformers 5 says so in scale_decoder_outputs (older configs: tie_word_embeddings).
        scale = getattr(config, "scale_decoder_outputs", None)
        self.scale_outputs = bool(getattr(config, "tie_word_embeddings", True) if scale is None else scale)
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = T5Stack(config, config.num_layers, decoder=False)
        num_decoder_layers = getattr(config, "num_decoder_layers", None) or config.num_layers
        self.decoder = T5Stack(config, num_decoder_layers, decoder=True)
        # The head is `shared` unless the checkpoint has its own lm_head.weight (Flan-T5's own files);
        # load_weights then adds it.
        self.lm_head: nn.Linear | None = None
        # The batchless ops of each decoder layer: self-attention (layer i's paged KV) and
        # cross-attention (the same tensor's cross blocks). T5 does not scale its logits.
        self.self_attn = nn.ModuleList(Attention(i, self.num_heads, self.num_heads, self.head_dim, 1.0)
                                       for i in range(num_decoder_layers))
        self.cross_attn = nn.ModuleList(CrossAttention(i, self.num_heads, self.num_heads, self.head_dim, 1.0)
                                        for i in range(num_decoder_layers))
        self._bias_ready = False

    # -- encoder ---------------------------------------------------------------------------------------
    def _bias(self, stack: T5Stack, q_pos: torch.Tensor, k_pos: torch.Tensor, bidirectional: bool) -> torch.Tensor:
        """[H, Q, K] relative position bias of the stack's first layer (shared by all its layers)."""
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
        N, L = len(embeds), max(lens)
        device = embeds[0].device
        x = torch.nn.utils.rnn.pad_sequence(embeds, batch_first=True)  # [N, L, d]
        pos = torch.arange(L, device=device)
        valid = pos[None, :] < torch.tensor(lens, device=device)[:, None]  # [N, L]
        bias = self._bias(self.encoder, pos, pos, bidirectional=True)[None].float()  # [1, H, L, L]
        bias = bias.masked_fill(~valid[:, None, None, :], torch.finfo(torch.float32).min)
        H, D = self.num_heads, self.head_dim
        for block in self.encoder.block:
            sub = block.layer[0]
            h = sub.layer_norm(x)
            proj = sub.SelfAttention
            q, k, v = (p(h).view(N, L, H, D).transpose(1, 2) for p in (proj.q, proj.k, proj.v))
            scores = (q @ k.transpose(-1, -2)).float() + bias
            attn = torch.softmax(scores, dim=-1).to(v.dtype) @ v
            x = x + proj.o(attn.transpose(1, 2).reshape(N, L, H * D))
            ff = block.layer[1]
            x = x + ff.DenseReluDense(ff.layer_norm(x))
        x = self.encoder.final_layer_norm(x)
        return x[valid]

    def store_cross_kv(self, hidden: torch.Tensor, slots: torch.Tensor, backend) -> None:
        """Projects encoder outputs [E, d_model] to every decoder layer's cross K/V, stored at `slots`."""
        for block, cross in zip(self.decoder.block, self.cross_attn):
            proj = block.layer[1].EncDecAttention
            cross.store(proj.k(hidden), proj.v(hidden), slots, backend)

    # -- decoder (the flat token stream) ---------------------------------------------------------------
    def _ensure_bias_table(self) -> None:
        """Tabulates the decoder's self-attention bias over query-key distances 0..max once (after the
        weights are in), for the attention backends: pos_bias[h, d]."""
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
            h = sub.layer_norm(x)
            p = sub.SelfAttention
            x = x + p.o(attn(p.q(h), p.k(h), p.v(h), positions))
            sub = block.layer[1]
            p = sub.EncDecAttention
            x = x + p.o(cross(p.q(sub.layer_norm(x))))
            sub = block.layer[2]
            x = x + sub.DenseReluDense(sub.layer_norm(x))
        return self.decoder.final_layer_norm(x)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.scale_outputs:
            hidden = hidden * self.d_model ** -0.5
        weight = self.shared.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight) if out is None else torch.mm(hidden, weight.t(), out=out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            tensor = as_tensor(tensor)  # a lazy slice of a file is read now (T5 is not sharded)
            if name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
                continue  # tied to `shared`
            if name == "lm_head.weight" and self.lm_head is None:
                w = self.shared.weight
                self.lm_head = nn.Linear(self.d_model, self.config.vocab_size, bias=False, device=w.device, dtype=w.dtype)
                params = dict(self.named_parameters())
            if name not in params:
                raise ValueError(f"unexpected T5 checkpoint tensor {name!r}")
            if params[name].shape != tensor.shape:
                raise ValueError(f"T5 tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}")
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
        self._bias_ready = False
        return loaded
