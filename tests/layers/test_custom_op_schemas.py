"""kernels/ops.py registers every splitserve custom op; the schemas are the engine's interface (CUDA
graphs, torch.compile caches and ONNX export name these ops), so they must not drift.

SCHEMAS are the schemas at commit 42141db, before the ops moved into the registry, printed there from
torch.ops.splitserve.<op>.default._schema and pasted here.
"""
import subprocess
import sys

import pytest
import torch

import splitserve.attention.cross  # noqa: F401  (binds the cross-attention body)
import splitserve.attention.layer  # noqa: F401  (binds the attention body)
from splitserve.kernels import ops

SCHEMAS = [
    'splitserve::attention(Tensor q, Tensor k, Tensor v, Tensor kv_cache, Tensor k_scale, Tensor v_scale, Tensor positions, Tensor? cos_sin, SymInt num_heads, SymInt num_kv_heads, float scale, SymInt sliding_window=0, float soft_cap=0., Tensor? pos_bias=None) -> Tensor',
    'splitserve::cross_attention(Tensor q, Tensor kv_cache, SymInt num_heads, SymInt num_kv_heads, float scale) -> Tensor',
    'splitserve::lora_add_(Tensor(a0!) out, Tensor x, Tensor lora_a, Tensor lora_b, Tensor num_tiles, Tensor token_slots, Tensor tile_slots, Tensor token_rows, SymInt[] shard_sizes, SymInt rank) -> ()',
    'splitserve::fused_moe(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids) -> Tensor',
    'splitserve::fp8_linear(Tensor x, Tensor w, Tensor w_scale, Tensor? bias) -> Tensor',
    'splitserve::silu_mul_fp8_linear(Tensor x, Tensor w, Tensor w_scale, Tensor? bias) -> Tensor',
    'splitserve::int8_linear(Tensor x, Tensor w, Tensor w_scale, Tensor? bias, Tensor? input_scale) -> Tensor',
    'splitserve::silu_mul_int8_linear(Tensor x, Tensor w, Tensor w_scale, Tensor? bias) -> Tensor',
    'splitserve::wna16_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? perm, Tensor? bias, SymInt bits, SymInt group_size) -> Tensor',
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: s.split("(")[0])
def test_schema_is_unchanged(schema):
    name = schema.split("(")[0].split("::")[1]
    assert str(getattr(torch.ops.splitserve, name).default._schema) == schema


def test_the_registry_holds_every_op_but_the_collectives():
    registered = {s.split("(")[0] for s in SCHEMAS}
    defined = {str(getattr(ops, n)._qualname) for n in dir(ops) if hasattr(getattr(ops, n), "_qualname")}
    assert defined == registered


def test_importing_the_registry_imports_no_triton():
    code = ("import sys, splitserve.kernels.ops; "
            "print(any(m == 'triton' or m.startswith('triton.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_only_the_attention_bodies_are_bound_from_above():
    with pytest.raises(ValueError):
        ops.implement("fused_moe", lambda *a: None)
