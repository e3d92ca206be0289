"""Tensor-parallel layers: each rank holds a part of a layer's weights and computes its part.

The tensor-parallel group comes from `distributed.parallel_state.tp_group()`; with one rank every
class here is exactly the plain layer it extends (same parameters, names, shapes and arithmetic).

- Column-parallel (`ColumnParallelLinear`, `MergedColumnParallelLinear` for gate/up, `QKVParallelLinear`):
  each rank computes its part of the output features; no communication. A merged layer's rank keeps
  its part of every shard, side by side ([q_r; k_r; v_r], [gate_r; up_r]).
- QKV with fewer KV heads than ranks: every rank gets one KV head; ranks r with the same
  r * num_kv_heads // tp share (replicate) it, which is the head their query heads attend with.
- Row-parallel (`RowParallelLinear`, o_proj / down_proj): each rank multiplies its part of the input
  features, one all-reduce sums the parts, then the bias is added once.
- Vocabulary-parallel embedding and LM head: rank r holds token rows [r * n, (r + 1) * n) of a
  vocabulary padded to tp * n. The embedding looks up its own rows (zeros for the others') and
  all-reduces; the LM head's logits are all-gathered and the padding cut off.

How a rank's part is cut from a checkpoint tensor is data: `layer.tp_output` (shard -> part index)
or `layer.tp_input` (part index), read by `quantization.base.rank_part` through each parameter's
ParamLayout, so quantized methods' weights and scales are cut along the right dimension.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.parallel.communication import tp_all_gather, tp_all_reduce
from splitserve.parallel.parallel_state import tp_group
from splitserve.layers.linear import Linear, MergedLinear
from splitserve.layers.quantization.base import LinearMethod, ParamLayout, as_tensor, register_param


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {parts}")
    return total // parts


def _tp() -> tuple[int, int]:
    g = tp_group()
    return g.rank, g.world_size


class ColumnParallelLinear(Linear):
    """out_features split over the ranks. `pad_output`: the last part may run past out_features
    (an LM head over a vocabulary that does not divide); those rows load as zeros."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, method: LinearMethod | None = None,
                 pad_output: bool = False):
        rank, size = _tp()
        local = -(-out_features // size) if pad_output else divide(out_features, size, "output features")
        self.full_out_features = out_features
        super().__init__(in_features, local, bias, method)
        if size > 1:
            self.tp_output = {None: rank}
            self.tp_pads_output = pad_output


class MergedColumnParallelLinear(MergedLinear):
    """Several column-parallel projections of one input (gate/up): each rank keeps its part of each."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False,
                 method: LinearMethod | None = None):
        rank, size = _tp()
        local = {name: divide(n, size, f"{name} output features") for name, n in shard_sizes.items()}
        super().__init__(in_features, local, bias, method)
        if size > 1:
            self.tp_output = {name: rank for name in shard_sizes}


class QKVParallelLinear(MergedLinear):
    """q, k, v of attention: each rank keeps num_heads / tp query heads and num_kv_heads / tp KV
    heads, or one replicated KV head when there are fewer KV heads than ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 method: LinearMethod | None = None):
        rank, size = _tp()
        self.num_heads, self.num_kv_heads, kv_index = local_heads(num_heads, num_kv_heads, rank, size)
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        super().__init__(hidden_size, {"q": q, "k": kv, "v": kv}, bias, method)
        if size > 1:
            self.tp_output = {"q": rank, "k": kv_index, "v": kv_index}


def local_heads(num_heads: int, num_kv_heads: int, rank: int, size: int) -> tuple[int, int, int]:
    """(query heads, KV heads) of a rank and the index of its KV part (in parts of its KV heads).
    Head counts that cannot be split evenly are a ValueError naming them, at start-up."""
    if num_heads % size:
        raise ValueError(f"tensor parallelism: {num_heads} query heads do not divide by the tensor-parallel "
                         f"size {size}; choose a size that divides {num_heads}")
    if num_kv_heads >= size:
        if num_kv_heads % size:
            raise ValueError(f"tensor parallelism: {num_kv_heads} KV heads do not divide by the tensor-parallel "
                             f"size {size}; choose a size that divides {num_kv_heads} (or a multiple of it)")
        return num_heads // size, num_kv_heads // size, rank
    if size % num_kv_heads:
        raise ValueError(f"tensor parallelism: {num_kv_heads} KV heads cannot be replicated evenly over "
                         f"{size} ranks; choose a size that divides or is a multiple of {num_kv_heads}")
    return num_heads // size, 1, rank * num_kv_heads // size


class RowParallelLinear(Linear):
    """in_features split over the ranks; the partial outputs are summed by one all-reduce. With more
    than one rank the bias is held apart (`output_bias`) and added after the sum, once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, method: LinearMethod | None = None):
        rank, size = _tp()
        self.full_in_features = in_features
        super().__init__(divide(in_features, size, "input features"), out_features, bias and size == 1, method)
        if size > 1:
            self.tp_input = rank
        if size > 1 and bias:  # the method must not add it on every rank
            register_param(self, "output_bias", torch.empty(out_features, dtype=self.params_dtype),
                           ParamLayout(output_dim=0))
        else:
            self.output_bias = None

    def load(self, param_name: str, tensor, shard: str | None = None) -> None:
        if param_name == "bias" and self.output_bias is not None:
            self.output_bias.data.copy_(as_tensor(tensor))
            return
        super().load(param_name, tensor, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.partial_forward(x))

    def forward_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        # a rank's gate_up is [gate_r | up_r]: silu(gate_r) * up_r is its part of the input features
        return self.reduce(self.method.apply_silu_mul(self, gate_up))

    def partial_forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output (before the sum over ranks): what a LoRA wrapper adds its
        own share of the delta to before `reduce`, so that one all-reduce sums both."""
        return self.method.apply(self, x)

    def reduce(self, out: torch.Tensor) -> torch.Tensor:
        out = tp_all_reduce(out)
        return out if self.output_bias is None else out + self.output_bias


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (tokens) are split over the ranks; `weight` as nn.Embedding's."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        rank, size = _tp()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.rows = -(-num_embeddings // size)  # this rank's rows, the last part zero-padded
        self.start = rank * self.rows
        self.tp_size = size
        self.weight = nn.Parameter(torch.empty(self.rows, embedding_dim), requires_grad=False)

    def load(self, param_name: str, tensor) -> None:
        """The checkpoint's [vocab, hidden] embedding (or tied head); this rank reads its rows."""
        if param_name != "weight":
            raise ValueError(f"no parameter {param_name!r} in the embedding")
        self.weight.data.copy_(vocab_rows(tensor, self.start, self.rows, self.num_embeddings))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.rows)
        out = F.embedding(torch.where(mine, local, torch.zeros_like(local)), self.weight)
        return tp_all_reduce(out * mine.unsqueeze(-1).to(out.dtype))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.start}, {self.start + self.rows})"


def vocab_rows(tensor, start: int, rows: int, vocab: int) -> torch.Tensor:
    """Rows [start, start + rows) of a [vocab, hidden] checkpoint tensor (read only those when it is
    a lazy slice), zero rows past the vocabulary."""
    if tensor.shape[0] != vocab:
        raise ValueError(f"checkpoint has {tensor.shape[0]} vocabulary rows, the model {vocab}")
    have = max(0, min(rows, vocab - start))
    part = as_tensor(tensor.narrow(0, min(start, vocab), have))
    return part if have == rows else F.pad(part, (0, 0, 0, rows - have))


class ParallelLMHead(ColumnParallelLinear):
    """The LM head: vocabulary rows split like VocabParallelEmbedding's (so a tied head can use the
    embedding's part); `gather` assembles every rank's logits and drops the padding."""

    def __init__(self, hidden_size: int, vocab_size: int, method: LinearMethod | None = None):
        super().__init__(hidden_size, vocab_size, method=method, pad_output=True)
        self.vocab_size = vocab_size

    def gather(self, local_logits: torch.Tensor) -> torch.Tensor:
        return tp_all_gather(local_logits)[..., :self.vocab_size]
