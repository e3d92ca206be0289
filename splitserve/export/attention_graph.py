"""The batchless part in plain ONNX: rotary + causal attention, built with onnx.helper.

One builder writes the same maths three times:
- the body of the local function `ai.splitserve::BatchlessAttention` (attributes by reference), which
  a runtime that does not know the op inlines: one sequence's prefill, no plugin;
- `batchless_prefill.onnx`: the same for one sequence, returning also the rotated K and V to store;
- `batchless_decode.onnx`: B sequences of one new token each over their past K/V (padded to L).

The maths is splitserve's (attention/backend.py, layers/rotary.py): q and k rotated NeoX-style over the
first rot_dim features of each head, the table `cos_sin` [max_position, rot_dim] (cos | sin halves)
gathered at the tokens' positions; a query at position p sees keys at p - W < n <= p (W the sliding
window, 0: all before it); logits scaled, soft-capped where soft_cap > 0; KV head j serves query heads
j*G .. j*G + G - 1 (G = heads / KV heads). Computed in fp32 whatever the graph's dtype.
"""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from splitserve.loading.onnx_export import OP_DOMAIN as DOMAIN
from splitserve.loading.onnx_export import OP_TYPE
from splitserve.loading.onnx_export import OP_VERSION as DOMAIN_VERSION

# Attributes of the node, in order, with their types and defaults (None: required).
ATTRIBUTES = (("num_heads", "int", None), ("num_kv_heads", "int", None), ("head_dim", "int", None),
              ("scale", "float", None), ("layer_idx", "int", None), ("sliding_window", "int", 0),
              ("soft_cap", "float", 0.0))
INPUTS = ("q", "k", "v", "positions", "cos_sin")
_INT_MAX = 2 ** 62


class _Builder:
    """Nodes of one graph or function body. `attrs`: concrete attribute values (a graph), or None
    (a function body: values by reference to the node's attributes)."""

    def __init__(self, attrs: dict | None):
        self.nodes: list[onnx.NodeProto] = []
        self.attrs = attrs
        self.n = 0

    def op(self, op_type: str, *inputs: str, outputs: int = 1, **kw) -> str | list[str]:
        self.n += 1
        names = [f"{op_type.lower()}_{self.n}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, **kw))
        return names[0] if outputs == 1 else names

    def const(self, values, dtype=TensorProto.INT64, dims=None) -> str:
        values = list(values) if isinstance(values, (list, tuple)) else [values]
        dims = [len(values)] if dims is None else dims
        return self.op("Constant", value=helper.make_tensor(f"c{self.n}", dtype, dims, values))

    def attr(self, name: str, kind: str) -> str:
        """A scalar tensor holding the node's attribute `name` (int64 or float)."""
        self.n += 1
        out = f"attr_{name}_{self.n}"
        key = "value_int" if kind == "int" else "value_float"
        if self.attrs is None:
            ref = helper.make_attribute_ref(key, onnx.AttributeProto.INT if kind == "int" else onnx.AttributeProto.FLOAT)
            ref.ref_attr_name = name
            node = helper.make_node("Constant", [], [out])
            node.attribute.append(ref)
        else:
            node = helper.make_node("Constant", [], [out], **{key: self.attrs[name]})
        self.nodes.append(node)
        return out

    def vec(self, *scalars: str) -> str:
        """A 1-D int64 shape from scalar int64 tensors."""
        return self.op("Concat", *[self.op("Unsqueeze", s, self.const([0])) for s in scalars], axis=0)


def _rotate(b: _Builder, x3: str, cos: str, sin: str, rot: str, half: str) -> str:
    """x3 [T, h, D] rotated at the gathered cos / sin [T, 1, rot/2], over features :rot."""
    zero, two, end = b.const([0]), b.const([2]), b.const([_INT_MAX])
    x1 = b.op("Slice", x3, zero, half, two)
    x2 = b.op("Slice", x3, half, rot, two)
    rest = b.op("Slice", x3, rot, end, two)
    a = b.op("Sub", b.op("Mul", x1, cos), b.op("Mul", x2, sin))
    c = b.op("Add", b.op("Mul", x2, cos), b.op("Mul", x1, sin))
    return b.op("Concat", a, c, rest, axis=2)


def _qkv_rotated(b: _Builder, q: str, k: str, v: str, positions: str, cos_sin: str):
    """q [T, H, D], k [T, Hkv, D] rotated and v [T, Hkv, D], in fp32; and H, Hkv, D as scalars."""
    H, Hkv, D = b.attr("num_heads", "int"), b.attr("num_kv_heads", "int"), b.attr("head_dim", "int")
    minus1 = b.const(-1, dims=[])
    f32 = TensorProto.FLOAT
    q3 = b.op("Reshape", b.op("Cast", q, to=f32), b.vec(minus1, H, D))
    k3 = b.op("Reshape", b.op("Cast", k, to=f32), b.vec(minus1, Hkv, D))
    v3 = b.op("Reshape", b.op("Cast", v, to=f32), b.vec(minus1, Hkv, D))
    table = b.op("Gather", b.op("Cast", cos_sin, to=f32), positions, axis=0)  # [T, rot]
    rot = b.op("Shape", cos_sin, start=1, end=2)
    half = b.op("Div", rot, b.const([2]))
    cos, sin = b.op("Split", table, outputs=2, axis=1, num_outputs=2)
    cos, sin = b.op("Unsqueeze", cos, b.const([1])), b.op("Unsqueeze", sin, b.const([1]))
    return _rotate(b, q3, cos, sin, rot, half), _rotate(b, k3, cos, sin, rot, half), v3, H, Hkv, D


def _attend(b: _Builder, scores: str, allowed: str, values: str) -> str:
    """softmax(cap(scores * scale) where allowed) @ values."""
    s = b.op("Mul", scores, b.attr("scale", "float"))
    cap = b.attr("soft_cap", "float")
    capped = b.op("Mul", b.op("Tanh", b.op("Div", s, cap)), cap)
    s = b.op("Where", b.op("Greater", cap, b.const(0.0, TensorProto.FLOAT, [])), capped, s)
    s = b.op("Where", allowed, s, b.const(float("-inf"), TensorProto.FLOAT, []))
    return b.op("MatMul", b.op("Softmax", s, axis=-1), values)


def _window_ok(b: _Builder, distance: str) -> str:
    """distance (query position - key position) inside the layer's window (always, without one)."""
    W = b.attr("sliding_window", "int")
    return b.op("Or", b.op("Equal", W, b.const(0, dims=[])), b.op("Less", distance, W))


def _one_sequence(b: _Builder, q: str, k: str, v: str, positions: str, cos_sin: str):
    """Causal attention of T tokens of one sequence over themselves: (out [T, H*D] fp32, k_rot, v3)."""
    qr, kr, v3, H, Hkv, D = _qkv_rotated(b, q, k, v, positions, cos_sin)
    minus1 = b.const(-1, dims=[])
    G = b.op("Div", H, Hkv)
    q4 = b.op("Transpose", b.op("Reshape", qr, b.vec(minus1, Hkv, G, D)), perm=[1, 2, 0, 3])  # [Hkv, G, T, D]
    kt = b.op("Unsqueeze", b.op("Transpose", kr, perm=[1, 2, 0]), b.const([1]))           # [Hkv, 1, D, T]
    vt = b.op("Unsqueeze", b.op("Transpose", v3, perm=[1, 0, 2]), b.const([1]))           # [Hkv, 1, T, D]
    distance = b.op("Sub", b.op("Unsqueeze", positions, b.const([1])), b.op("Unsqueeze", positions, b.const([0])))
    allowed = b.op("And", b.op("GreaterOrEqual", distance, b.const(0, dims=[])), _window_ok(b, distance))
    out = _attend(b, b.op("MatMul", q4, kt), allowed, vt)                                  # [Hkv, G, T, D]
    out = b.op("Transpose", out, perm=[2, 0, 1, 3])
    return b.op("Reshape", out, b.vec(minus1, b.op("Mul", H, D))), kr, v3


def batchless_attention_function() -> onnx.FunctionProto:
    """The local function that defines ai.splitserve::BatchlessAttention in plain ONNX."""
    b = _Builder(None)
    out, _, _ = _one_sequence(b, *INPUTS)
    b.nodes.append(helper.make_node("CastLike", [out, "q"], ["out"]))
    return helper.make_function(
        DOMAIN, OP_TYPE, list(INPUTS), ["out"], b.nodes, opset_imports=[helper.make_opsetid("", 18)],
        attributes=[name for name, _, default in ATTRIBUTES if default is None],
        attribute_protos=[helper.make_attribute(name, default) for name, _, default in ATTRIBUTES
                          if default is not None],
        doc_string="Rotary embedding + causal attention of the given tokens, as one sequence (a prefill). "
                   "A serving runtime replaces it by a plugin that attends over each sequence's paged KV cache.")


def _io(name: str, elem: int, shape: list) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def batchless_prefill_model(attrs: dict, elem: int, rot_dim: int, opset: int) -> onnx.ModelProto:
    """One sequence's prefill of one layer: q, k, v [T, heads * D] at positions [T] -> out [T, H*D] and
    the K (rotated) and V [T, Hkv, D] a runtime stores in its cache."""
    b = _Builder(attrs)
    out, kr, v3 = _one_sequence(b, *INPUTS)
    b.nodes += [helper.make_node("Cast", [out], ["out"], to=elem), helper.make_node("Cast", [kr], ["k_cache"], to=elem),
                helper.make_node("Cast", [v3], ["v_cache"], to=elem)]
    H, Hkv, D = attrs["num_heads"], attrs["num_kv_heads"], attrs["head_dim"]
    inputs = [_io("q", elem, ["tokens", H * D]), _io("k", elem, ["tokens", Hkv * D]), _io("v", elem, ["tokens", Hkv * D]),
              _io("positions", TensorProto.INT64, ["tokens"]), _io("cos_sin", TensorProto.FLOAT, ["max_position", rot_dim])]
    outputs = [_io("out", elem, ["tokens", H * D]), _io("k_cache", elem, ["tokens", Hkv, D]),
               _io("v_cache", elem, ["tokens", Hkv, D])]
    graph = helper.make_graph(b.nodes, "batchless_prefill", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="splitserve")


def batchless_decode_model(attrs: dict, elem: int, rot_dim: int, opset: int) -> onnx.ModelProto:
    """One new token for each of B sequences of one layer: q, k, v [B, heads * D] at positions [B] over
    past_k / past_v [B, L, Hkv, D] (rotated keys; row b's first context_lens[b] entries are its past)
    -> out [B, H*D] and the new token's rotated K and its V [B, Hkv, D]."""
    b = _Builder(attrs)
    qr, kr, v3, H, Hkv, D = _qkv_rotated(b, *INPUTS)
    minus1 = b.const(-1, dims=[])
    f32 = TensorProto.FLOAT
    keys = b.op("Concat", b.op("Cast", "past_k", to=f32), b.op("Unsqueeze", kr, b.const([1])), axis=1)    # [B, L+1, Hkv, D]
    vals = b.op("Concat", b.op("Cast", "past_v", to=f32), b.op("Unsqueeze", v3, b.const([1])), axis=1)
    G = b.op("Div", H, Hkv)
    q4 = b.op("Reshape", qr, b.vec(minus1, Hkv, G, D))                                   # [B, Hkv, G, D]
    kt = b.op("Transpose", keys, perm=[0, 2, 3, 1])                                      # [B, Hkv, D, L+1]
    vt = b.op("Transpose", vals, perm=[0, 2, 1, 3])                                      # [B, Hkv, L+1, D]
    # key j < L is past token j (position j); key L is the new token itself
    L = b.op("Shape", "past_k", start=1, end=2)
    j = b.op("Range", b.const(0, dims=[]), b.op("Add", b.op("Squeeze", L, b.const([0])), b.const(1, dims=[])),
             b.const(1, dims=[]))
    key_pos = b.op("Unsqueeze", j, b.const([0]))                                        # [1, L+1]
    ctx = b.op("Unsqueeze", "context_lens", b.const([1]))                                # [B, 1]
    distance = b.op("Sub", b.op("Unsqueeze", "positions", b.const([1])), key_pos)
    past_ok = b.op("And", b.op("Less", key_pos, ctx), _window_ok(b, distance))
    allowed = b.op("Or", past_ok, b.op("Equal", key_pos, L))
    allowed = b.op("Unsqueeze", allowed, b.const([1, 2, 3]))                            # [B, 1, 1, 1, L+1]
    scores = b.op("MatMul", b.op("Unsqueeze", q4, b.const([3])), b.op("Unsqueeze", kt, b.const([2])))  # [B,Hkv,G,1,L+1]
    out = _attend(b, scores, allowed, b.op("Unsqueeze", vt, b.const([2])))                # [B, Hkv, G, 1, D]
    out = b.op("Reshape", out, b.vec(minus1, b.op("Mul", H, D)))
    b.nodes += [helper.make_node("Cast", [out], ["out"], to=elem), helper.make_node("Cast", [kr], ["k_new"], to=elem),
                helper.make_node("Cast", [v3], ["v_new"], to=elem)]
    Hq, Hk, Dv = attrs["num_heads"], attrs["num_kv_heads"], attrs["head_dim"]
    inputs = [_io("q", elem, ["batch", Hq * Dv]), _io("k", elem, ["batch", Hk * Dv]), _io("v", elem, ["batch", Hk * Dv]),
              _io("positions", TensorProto.INT64, ["batch"]), _io("cos_sin", TensorProto.FLOAT, ["max_position", rot_dim]),
              _io("past_k", elem, ["batch", "past", Hk, Dv]), _io("past_v", elem, ["batch", "past", Hk, Dv]),
              _io("context_lens", TensorProto.INT64, ["batch"])]
    outputs = [_io("out", elem, ["batch", Hq * Dv]), _io("k_new", elem, ["batch", Hk, Dv]),
               _io("v_new", elem, ["batch", Hk, Dv])]
    graph = helper.make_graph(b.nodes, "batchless_decode", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="splitserve")


def register_schema() -> None:
    """Makes the op known to onnx's schema registry in this process, so that torch's exporter (through
    onnxscript) can emit it. Nothing is written by this: the exported file carries the local function."""
    from onnx.defs import OpSchema, has
    if has(OP_TYPE, DOMAIN):
        return
    kinds = {"int": OpSchema.AttrType.INT, "float": OpSchema.AttrType.FLOAT}
    formal = OpSchema.FormalParameter
    schema = OpSchema(
        OP_TYPE, DOMAIN, DOMAIN_VERSION, doc="splitserve's batchless cut (see export/attention_graph.py)",
        inputs=[formal("q", "T"), formal("k", "T"), formal("v", "T"), formal("positions", "tensor(int64)"),
                formal("cos_sin", "tensor(float)")],
        outputs=[formal("out", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "activations")],
        attributes=[OpSchema.Attribute(name, kinds[kind], "") if default is None
                    else OpSchema.Attribute(name, helper.make_attribute(name, default), "")
                    for name, kind, default in ATTRIBUTES])
    onnx.defs.register_schema(schema)
