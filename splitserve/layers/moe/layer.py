"""FusedMoE: the sparse MLP of Mixtral and Qwen2-MoE decoder layers, over the flat token stream.

    out = sum over the token's top-k experts e of g_e * down_e(silu(gate_e(x)) * up_e(x))
          [+ sigmoid(x . shared_gate) * shared_expert(x)]          (Qwen2-MoE only)

All experts' weights sit in one tensor each, w13 [E, 2I, H] (every expert's gate rows, then its up
rows) and w2 [E, H, I], so a token picks its weights by an expert id (an index tensor) and one
kernel launch serves every expert (fused_moe.py). The router and the shared expert are small dense
matmuls left to torch (and to the compiler around the op).

Checkpoint names (relative to the decoder layer) map onto the parameters through
`checkpoint_target`:

    Mixtral     block_sparse_moe.gate.weight              -> router
                block_sparse_moe.experts.{e}.w1/w3.weight -> w13[e] gate / up shard
                block_sparse_moe.experts.{e}.w2.weight    -> w2[e]
    Qwen2-MoE   mlp.gate.weight                           -> router
                mlp.experts.{e}.gate_proj/up_proj.weight  -> w13[e] gate / up shard
                mlp.experts.{e}.down_proj.weight          -> w2[e]
                mlp.shared_expert.gate_proj/up_proj.weight -> shared_w13 gate / up shard
                mlp.shared_expert.down_proj.weight        -> shared_w2
                mlp.shared_expert_gate.weight             -> shared_gate
    both, as transformers >= 5 saves them: {prefix}.experts.gate_up_proj [E, 2I, H] -> w13,
                {prefix}.experts.down_proj [E, H, I] -> w2

Tensor parallelism and quantized experts are not handled here yet (the weights are whole and float).
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.kernels.ops import fused_moe_op
from splitserve.layers.moe.router import topk_route

_PREFIX = r"(?:block_sparse_moe|mlp)"
_EXPERT_SHARDS = {"w1": ("w13", "gate"), "w3": ("w13", "up"), "w2": ("w2", None),
                  "gate_proj": ("w13", "gate"), "up_proj": ("w13", "up"), "down_proj": ("w2", None)}
_SHARED_SHARDS = {"gate_proj": ("shared_w13", "gate"), "up_proj": ("shared_w13", "up"),
                  "down_proj": ("shared_w2", None)}
_PATTERNS = [
    (re.compile(rf"^{_PREFIX}\.gate\.weight$"), lambda m: ("router", None, None)),
    (re.compile(rf"^{_PREFIX}\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"),
     lambda m: (_EXPERT_SHARDS[m[2]][0], int(m[1]), _EXPERT_SHARDS[m[2]][1])),
    (re.compile(rf"^{_PREFIX}\.experts\.(gate_up_proj|down_proj)$"),
     lambda m: ("w13" if m[1] == "gate_up_proj" else "w2", None, None)),
    (re.compile(r"^mlp\.shared_expert\.(gate_proj|up_proj|down_proj)\.weight$"),
     lambda m: (_SHARED_SHARDS[m[1]][0], None, _SHARED_SHARDS[m[1]][1])),
    (re.compile(r"^mlp\.shared_expert_gate\.weight$"), lambda m: ("shared_gate", None, None)),
]


def checkpoint_target(name: str) -> tuple[str, int | None, str | None] | None:
    """A checkpoint tensor's name relative to its decoder layer ("block_sparse_moe.experts.3.w1.weight")
    -> (parameter, expert id or None, shard or None) for FusedMoE.load; None if it is no MoE tensor."""
    for pattern, target in _PATTERNS:
        m = pattern.match(name)
        if m:
            return target(m)
    return None


class FusedMoE(nn.Module):
    """Router + routed experts (+ an optional gated shared expert) on [..., hidden] activations.

    renormalize: rescale the top-k weights to sum to one (Mixtral always; Qwen2-MoE when the config
    sets norm_topk_prob). shared_expert_intermediate_size > 0 adds Qwen2-MoE's shared expert (a
    SiLU-gated MLP on every token) scaled by sigmoid(x . shared_gate)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *,
                 renormalize: bool = True, shared_expert_intermediate_size: int = 0,
                 params_dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        super().__init__()
        if num_experts < 1 or not 1 <= top_k <= num_experts:
            raise ValueError(f"need 1 <= top_k ({top_k}) <= num_experts ({num_experts})")
        if min(hidden_size, intermediate_size) < 1 or shared_expert_intermediate_size < 0:
            raise ValueError(f"bad sizes: hidden {hidden_size}, intermediate {intermediate_size}, "
                             f"shared expert intermediate {shared_expert_intermediate_size}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.shared_intermediate_size = shared_expert_intermediate_size
        dt = params_dtype or torch.get_default_dtype()
        E, H, I, S = num_experts, hidden_size, intermediate_size, shared_expert_intermediate_size

        def param(*shape):
            return nn.Parameter(torch.empty(*shape, dtype=dt, device=device), requires_grad=False)

        self.router = param(E, H)
        self.w13 = param(E, 2 * I, H)
        self.w2 = param(E, H, I)
        if S:
            self.shared_w13 = param(2 * S, H)
            self.shared_w2 = param(H, S)
            self.shared_gate = param(1, H)
        else:
            self.shared_w13 = self.shared_w2 = self.shared_gate = None
        self._loaded: set[tuple[str, int | None, str | None]] = set()

    # -- compute ---------------------------------------------------------------------------------
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_weights fp32 [T, k], topk_ids int32 [T, k])."""
        return topk_route(F.linear(x, self.router), self.top_k, self.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"expected hidden size {self.hidden_size}, got input of shape {tuple(x.shape)}")
        x2 = x.reshape(-1, self.hidden_size)
        topk_weights, topk_ids = self.route(x2)
        out = fused_moe_op(x2, self.w13, self.w2, topk_weights, topk_ids)
        if self.shared_w13 is not None:
            gate, up = F.linear(x2, self.shared_w13).chunk(2, dim=-1)
            shared = F.linear(F.silu(gate) * up, self.shared_w2)
            out = out + torch.sigmoid(F.linear(x2, self.shared_gate)) * shared
        return out.reshape(x.shape)

    # -- weights ---------------------------------------------------------------------------------
    def load(self, name: str, tensor: torch.Tensor, expert_id: int | None = None, shard: str | None = None) -> None:
        """One checkpoint tensor into parameter `name` (router, w13, w2, shared_w13, shared_w2,
        shared_gate): of one expert when expert_id is given (w13, w2), else of all experts at once;
        of the gate or up half when shard is "gate" / "up" (w13, shared_w13), else whole."""
        param = getattr(self, name, None) if name in self._param_names() else None
        if param is None:
            raise ValueError(f"FusedMoE has no parameter {name!r}; it has {self._param_names()}")
        if expert_id is not None:
            if name not in ("w13", "w2"):
                raise ValueError(f"{name} is not per expert; got expert id {expert_id}")
            if not 0 <= expert_id < self.num_experts:
                raise ValueError(f"expert id {expert_id} out of range for {self.num_experts} experts")
        if shard is not None and name not in ("w13", "shared_w13"):
            raise ValueError(f"{name} has no shards; got shard {shard!r}")
        if shard not in (None, "gate", "up"):
            raise ValueError(f"unknown shard {shard!r}; {name} has 'gate' and 'up'")
        dest = param.data if expert_id is None else param.data[expert_id]
        if shard is not None:
            half = dest.shape[-2] // 2
            dest = dest[..., :half, :] if shard == "gate" else dest[..., half:, :]
        if tuple(tensor.shape) != tuple(dest.shape):
            where = f"{name}" + (f"[expert {expert_id}]" if expert_id is not None else "") + (f" {shard}" if shard else "")
            raise ValueError(f"{where}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(dest.shape)}")
        dest.copy_(tensor)
        self._loaded.add((name, expert_id, shard))

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """load() by the checkpoint's name relative to the decoder layer (see checkpoint_target)."""
        target = checkpoint_target(name)
        if target is None:
            raise ValueError(f"{name!r} is not a mixture-of-experts tensor name this layer knows")
        self.load(target[0], tensor, target[1], target[2])

    def missing_weights(self) -> list[str]:
        """What no load() has filled yet (an expert or a half missing from a checkpoint would
        otherwise serve uninitialised memory)."""
        missing = []
        for name in self._param_names():
            if (name, None, None) in self._loaded:
                continue
            halves = ("gate", "up") if name in ("w13", "shared_w13") else (None,)
            experts = range(self.num_experts) if name in ("w13", "w2") else (None,)
            for e in experts:
                for h in halves:
                    if not {(name, e, h), (name, e, None), (name, None, h)} & self._loaded:
                        missing.append(name + (f"[{e}]" if e is not None else "") + (f".{h}" if h else ""))
        return missing

    def _param_names(self) -> list[str]:
        names = ["router", "w13", "w2"]
        return names + (["shared_w13", "shared_w2", "shared_gate"] if self.shared_w13 is not None else [])

    def extra_repr(self) -> str:
        shared = f", shared_expert={self.shared_intermediate_size}" if self.shared_intermediate_size else ""
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, renormalize={self.renormalize}{shared}")
