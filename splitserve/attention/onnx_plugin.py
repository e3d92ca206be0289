"""The batchless part under ONNX Runtime: each `ai.splitserve::BatchlessAttention` node of an exported
batchful graph calls back into splitserve's paged attention, as the seed's TensorRT plugin hands its
node to a dedicated server.

The node becomes an onnxruntime-extensions Python op (the extensions' PyOp: a custom-op kernel that
calls a Python function with numpy views of its inputs). Such ops live in the extensions' own domain
(`ai.onnx.contrib`), so the runner (worker/onnx_runner.py) rewrites the nodes' domain in memory; the file on disk keeps
`ai.splitserve` and its local function. The body is the serving op's (attention/layer.py): the
backend's forward on the step's metadata from the forward context, over the layer's paged KV cache,
which the runner binds once (`bind_kv_caches`). Scheduling, batching, the pool and prefix caching stay
the engine's.
"""
from __future__ import annotations

import numpy as np
import torch

from splitserve.attention.layer import current_context

CONTRIB_DOMAIN = "ai.onnx.contrib"
_ATTRS = ("num_heads", "num_kv_heads", "head_dim", "scale", "layer_idx", "sliding_window", "soft_cap")
# The Python op is registered for fp32 tensors only (the extensions' hook does not convert fp16 outputs):
# a float16 graph casts around it (worker/onnx_runner.py), and the body attends in the cache's dtype.
OP_NAME = "BatchlessAttention"


class _State:
    kv_caches: list[torch.Tensor] = []
    scales: torch.Tensor | None = None  # the one-element fp32 k/v scale (1.0: the cache is not FP8)
    calls = 0  # how many nodes ran through the plugin (tests check the plugin, not an inlined body, ran)
    # The rotary table is the same initializer for every node and step: converted once, found again by
    # its buffer's address and shape.
    tables: dict[tuple, torch.Tensor] = {}


def bind_kv_caches(kv_caches: list[torch.Tensor]) -> None:
    """The runner's per-layer caches, indexed by the nodes' layer_idx attribute."""
    _State.kv_caches = kv_caches
    _State.tables = {}
    _State.scales = torch.ones(1, dtype=torch.float32, device=kv_caches[0].device if kv_caches else "cpu")


def num_calls() -> int:
    return _State.calls


def _tensor(x: np.ndarray, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    # ORT's input buffers are read-only views: torch wants writable memory, and the backend must not
    # write into ORT's arrays anyway, so the few kilobytes per node are copied.
    return torch.from_numpy(np.array(x)).to(device, dtype=dtype, non_blocking=True)


def _table(cos_sin: np.ndarray, device: torch.device) -> torch.Tensor:
    key = (cos_sin.__array_interface__["data"][0], cos_sin.shape, str(device))
    table = _State.tables.get(key)
    if table is None:
        table = _State.tables[key] = _tensor(cos_sin, device)
    return table


def batchless_attention(q, k, v, positions, cos_sin, **attrs):
    ctx = current_context()
    if ctx is None:
        raise RuntimeError("BatchlessAttention ran outside a step: the runner sets the forward context")
    layer = int(attrs["layer_idx"])
    cache = _State.kv_caches[layer]
    H, Hkv, D = int(attrs["num_heads"]), int(attrs["num_kv_heads"]), int(attrs["head_dim"])
    dev = cache.device
    act = cache.dtype if cache.dtype in (torch.float16, torch.bfloat16, torch.float32) else None
    T = q.shape[0]
    out = ctx.backend.forward(_tensor(q, dev, act).view(T, H, D), _tensor(k, dev, act).view(T, Hkv, D),
                              _tensor(v, dev, act).view(T, Hkv, D), cache, ctx.meta, float(attrs["scale"]),
                              _tensor(positions, dev), _table(cos_sin, dev), k_scale=_State.scales,
                              v_scale=_State.scales, sliding_window=int(attrs.get("sliding_window", 0)) or None,
                              soft_cap=float(attrs.get("soft_cap", 0.0)) or None)
    _State.calls += 1
    return out.reshape(T, H * D).float().cpu().numpy()


_registered = False


def register() -> str:
    """Registers the Python ops (once per process); returns the extensions' library to load into a
    session (SessionOptions.register_custom_ops_library)."""
    global _registered
    from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op
    if not _registered:
        dt = PyCustomOpDef
        attrs = {"num_heads": dt.dt_int64, "num_kv_heads": dt.dt_int64, "head_dim": dt.dt_int64,
                 "scale": dt.dt_float, "layer_idx": dt.dt_int64, "sliding_window": dt.dt_int64,
                 "soft_cap": dt.dt_float}
        f32 = dt.dt_float
        onnx_op(op_type=OP_NAME, inputs=[f32, f32, f32, dt.dt_int64, f32], outputs=[f32],
                attrs=attrs)(batchless_attention)
        _registered = True
    return get_library_path()

