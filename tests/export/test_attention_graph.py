"""The plain-ONNX batchless part (export/attention_graph.py) vs splitserve's torch maths: rotary at the
tokens' positions + causal (optionally windowed, soft-capped) attention with grouped KV heads."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402

from splitserve.export.attention_graph import (  # noqa: E402
    DOMAIN, OP_TYPE, batchless_attention_function, batchless_decode_model, batchless_prefill_model)
from splitserve.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402

H, HKV, D = 4, 2, 16


def reference(q, k, v, positions, cos_sin, scale, window=0, soft_cap=0.0):
    """[T, H*D] q, [T, Hkv*D] k/v of one sequence -> [T, H*D], in torch."""
    T = q.shape[0]
    q = apply_rotary(q.view(T, H, D), positions, cos_sin).transpose(0, 1)
    k = apply_rotary(k.view(T, HKV, D), positions, cos_sin).transpose(0, 1).repeat_interleave(H // HKV, 0)
    v = v.view(T, HKV, D).transpose(0, 1).repeat_interleave(H // HKV, 0)
    s = q @ k.transpose(1, 2) * scale
    if soft_cap:
        s = soft_cap * torch.tanh(s / soft_cap)
    dist = positions[:, None] - positions[None, :]
    ok = (dist >= 0) & ((dist < window) if window else True)
    s = s.masked_fill(~ok, float("-inf"))
    return (F.softmax(s, -1) @ v).transpose(0, 1).reshape(T, H * D)


def table(rot_dim=D):
    return RotaryEmbedding(D, 64, {"rope_type": "default", "rope_theta": 10000.0,
                                   "partial_rotary_factor": rot_dim / D}).cos_sin


def node_model(attrs: dict) -> onnx.ModelProto:
    """A graph of one BatchlessAttention node, defined only by its local function."""
    f32 = TensorProto.FLOAT
    node = helper.make_node(OP_TYPE, ["q", "k", "v", "positions", "cos_sin"], ["out"], domain=DOMAIN, **attrs)
    graph = helper.make_graph([node], "g", [
        helper.make_tensor_value_info("q", f32, ["T", H * D]), helper.make_tensor_value_info("k", f32, ["T", HKV * D]),
        helper.make_tensor_value_info("v", f32, ["T", HKV * D]),
        helper.make_tensor_value_info("positions", TensorProto.INT64, ["T"]),
        helper.make_tensor_value_info("cos_sin", f32, ["P", "R"])], [helper.make_tensor_value_info("out", f32, ["T", H * D])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)],
                              functions=[batchless_attention_function()])
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("window,soft_cap,rot_dim", [(0, 0.0, D), (5, 0.0, D), (0, 7.5, D), (0, 0.0, D // 2)])
def test_function_body_matches_torch(window, soft_cap, rot_dim):
    torch.manual_seed(0)
    T, scale = 11, D ** -0.5
    q, k, v = torch.randn(T, H * D), torch.randn(T, HKV * D), torch.randn(T, HKV * D)
    positions = torch.arange(3, 3 + T)
    cos_sin = table(rot_dim)
    attrs = dict(num_heads=H, num_kv_heads=HKV, head_dim=D, scale=scale, layer_idx=0)
    if window:
        attrs["sliding_window"] = window
    if soft_cap:
        attrs["soft_cap"] = soft_cap
    sess = ort.InferenceSession(node_model(attrs).SerializeToString(), providers=["CPUExecutionProvider"])
    got, = sess.run(None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "positions": positions.numpy(),
                           "cos_sin": cos_sin.numpy()})
    want = reference(q, k, v, positions, cos_sin, scale, window, soft_cap)
    np.testing.assert_allclose(got, want.numpy(), atol=1e-5, rtol=1e-5)


def test_prefill_then_decode_graphs_agree_with_one_prefill():
    """Decode of token T over the prefill's cache gives the prefill of T + 1 tokens' last row."""
    torch.manual_seed(1)
    T, scale = 9, 0.3
    attrs = dict(num_heads=H, num_kv_heads=HKV, head_dim=D, scale=scale, layer_idx=0, sliding_window=0, soft_cap=0.0)
    prefill, decode = (batchless_prefill_model(attrs, TensorProto.FLOAT, D, 18),
                       batchless_decode_model(attrs, TensorProto.FLOAT, D, 18))
    for m in (prefill, decode):
        onnx.checker.check_model(m, full_check=True)
    pre = ort.InferenceSession(prefill.SerializeToString(), providers=["CPUExecutionProvider"])
    dec = ort.InferenceSession(decode.SerializeToString(), providers=["CPUExecutionProvider"])
    q, k, v = torch.randn(T + 1, H * D), torch.randn(T + 1, HKV * D), torch.randn(T + 1, HKV * D)
    cos_sin = table().numpy()
    full_out, _, _ = pre.run(None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(),
                                    "positions": np.arange(T + 1), "cos_sin": cos_sin})
    np.testing.assert_allclose(full_out, reference(q, k, v, torch.arange(T + 1), torch.from_numpy(cos_sin), scale).numpy(),
                               atol=1e-5, rtol=1e-5)
    _, kc, vc = pre.run(None, {"q": q[:T].numpy(), "k": k[:T].numpy(), "v": v[:T].numpy(),
                               "positions": np.arange(T), "cos_sin": cos_sin})
    # two rows: the real sequence, and one padded past (context 4 of the same cache) at position 4
    past_k, past_v = np.stack([kc, kc]), np.stack([vc, vc])
    rows = torch.stack([q[T], q[4]]), torch.stack([k[T], k[4]]), torch.stack([v[T], v[4]])
    out, k_new, _ = dec.run(None, {"q": rows[0].numpy(), "k": rows[1].numpy(), "v": rows[2].numpy(),
                                   "positions": np.array([T, 4]), "cos_sin": cos_sin, "past_k": past_k,
                                   "past_v": past_v, "context_lens": np.array([T, 4])})
    np.testing.assert_allclose(out[0], full_out[T], atol=1e-5, rtol=1e-5)
    short = reference(q[:5], k[:5], v[:5], torch.arange(5), torch.from_numpy(cos_sin), scale)
    np.testing.assert_allclose(out[1], short[4].numpy(), atol=1e-5, rtol=1e-5)
    assert k_new.shape == (2, HKV, D)
