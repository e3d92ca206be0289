"""FP8 (e4m3) KV cache: quantize-on-store and dequantize-on-read with per-layer k/v scales, in the
torch reference (torch_ref.py) and in the Triton store, ragged and split-K decode kernels.

The oracle for the format is built here from the bits: every finite e4m3 value decoded from its
sign, exponent and mantissa, and x quantized to the nearest one (ties to an even mantissa) after
x / scale in fp32, saturated at +-448. The reference backend is checked against it; the kernels
against the reference. On CPU the kernels run in the Triton interpreter, whose fp32 -> fp8 cast
mis-rounds; tests/triton_interpreter_shims.py routes that cast through torch's (which, like the
GPU's satfinite conversion, saturates), and the interpreter's fp8 loads are right as they are.
"""
import pytest
import torch

from tests import triton_interpreter_shims

triton_interpreter_shims.install()  # before any kernel runs; see the module

from tests.attention.test_triton_attention import DEVICE, SCENARIOS, TOL, make_batch  # noqa: E402

from splitserve.attention.layer import Attention, kv_scale_targets  # noqa: E402
from splitserve.kernels.attention.paged_attention import paged_decode_attention, ragged_paged_attention  # noqa: E402
from splitserve.kernels.attention.store_kv import store_kv  # noqa: E402
from splitserve.attention.torch_ref import (  # noqa: E402
    TorchRefBackend, decode_attention_batched, gather_context, paged_attention_ref, store_kv_ref)
from splitserve.attention.triton_backend import TritonBackend, TritonMetadata  # noqa: E402
from splitserve.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402

FP8 = torch.float8_e4m3fn


# ------------------------------------------------------------------------------- the e4m3 oracle

def e4m3_values() -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, values in float64) of every finite e4m3 number: 1 sign bit, 4 exponent bits (bias 7),
    3 mantissa bits, exponent 0 subnormal, S.1111.111 NaN (no infinities)."""
    codes, values = [], []
    for c in range(256):
        if c & 0x7F == 0x7F:
            continue
        sign = -1.0 if c & 0x80 else 1.0
        e, m = (c >> 3) & 0xF, c & 0x7
        values.append(sign * (2.0 ** -6 * m / 8 if e == 0 else 2.0 ** (e - 7) * (1 + m / 8)))
        codes.append(c)
    return torch.tensor(codes), torch.tensor(values, dtype=torch.float64)


def e4m3_quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """The e4m3 value (float64) nearest to x / scale (computed in fp32), ties to the even code,
    saturated at the largest finite value 448."""
    codes, values = e4m3_values()
    y = (x.float().cpu() / torch.tensor(scale, dtype=torch.float32)).double().clamp(-448, 448).flatten()
    dist = (y[:, None] - values[None, :]).abs()
    nearest = dist == dist.min(dim=1, keepdim=True).values
    even = nearest & (codes % 2 == 0)[None, :]
    pick = torch.where(even.any(1), even.float().argmax(1), nearest.float().argmax(1))
    return values[pick].view(x.shape)


def fp32(x: float) -> float:
    """x rounded to fp32, as the scale buffers hold it."""
    return torch.tensor(x, dtype=torch.float32).item()


def scale_tensor(value: float) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float32, device=DEVICE)


def test_oracle_agrees_with_torch_cast():
    """The oracle is what torch's own float8_e4m3fn cast does to in-range values (a check of the
    oracle itself, over every code's neighbourhood: midpoints, just above and below them)."""
    _, values = e4m3_values()
    v = values.unique().sort().values
    mids = (v[1:] + v[:-1]) / 2
    x = torch.cat([v, mids, mids * (1 + 2 ** -20), mids * (1 - 2 ** -20)]).float()
    torch.testing.assert_close(e4m3_quantize(x, 1.0), x.to(FP8).double(), atol=0, rtol=0)


# -------------------------------------------------------------------------- reference round trip

def _paged_slots(seq_lens, block_size, num_blocks, g):
    """Each sequence's blocks drawn from a shuffled pool (out of order, not contiguous): its block
    table row and the slot of each of its positions."""
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots = [], []
    for n in seq_lens:
        ids = [perm.pop() for _ in range(-(-n // block_size))]
        tables.append(torch.tensor(ids, dtype=torch.int32))
        slots += [ids[p // block_size] * block_size + p % block_size for p in range(n)]
    return tables, torch.tensor(slots)


def test_reference_round_trip_matches_the_e4m3_oracle():
    g = torch.Generator().manual_seed(11)
    seq_lens, block_size, num_kv_heads, head_dim = [7, 13, 4], 4, 2, 16
    tables, slots = _paged_slots(seq_lens, block_size, 12, g)
    T = len(slots)
    k = torch.randn(T, num_kv_heads, head_dim, generator=g) * 3
    v = torch.randn(T, num_kv_heads, head_dim, generator=g) * 0.2
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 9.0, -8.97])  # saturates at +-448 * k_scale; in range
    k[1, 1, :3] = torch.tensor([1e-6, -3e-4, 0.0])      # e4m3 subnormals and zero
    k_scale, v_scale = 0.02, 0.5
    cache = torch.zeros(12, 2, block_size, num_kv_heads, head_dim, dtype=FP8)
    store_kv_ref(k, v, cache, slots, torch.tensor([k_scale]), torch.tensor([v_scale]))
    start = 0
    for table, n in zip(tables, seq_lens):
        k8, v8 = gather_context(cache, table, n)
        assert k8.dtype == FP8
        # dequantized as the attention reads it: stored value times the scale, in fp32
        got_k, got_v = k8.float() * torch.tensor([k_scale]), v8.float() * torch.tensor([v_scale])
        want_k = (e4m3_quantize(k[start:start + n], k_scale) * fp32(k_scale)).float()
        want_v = (e4m3_quantize(v[start:start + n], v_scale) * fp32(v_scale)).float()
        torch.testing.assert_close(got_k, want_k, atol=0, rtol=0)
        torch.testing.assert_close(got_v, want_v, atol=0, rtol=0)
        start += n
    # The error is e4m3's: half a step (2^-4 relative, 2^-10 * scale near zero) where not saturated.
    k8, _ = gather_context(cache, tables[0], seq_lens[0])
    err = (k8.float() * k_scale - k[:7]).abs()
    in_range = k[:7].abs() <= 448 * k_scale
    assert torch.all(err[in_range] <= torch.maximum(k[:7].abs() * 2 ** -4, torch.tensor(k_scale * 2 ** -10))[in_range])
    assert k8[0, 0, 0].float() == 448 and k8[0, 0, 1].float() == -448


@pytest.mark.parametrize("group", [1, 4])
def test_reference_attention_reads_fp8_as_scaled_values(group):
    """The reference over an FP8 cache with scales equals the reference over an fp32 cache holding
    the dequantized values (both the per-sequence loop and the batched decode path)."""
    seqs = [(21, 1), (5, 1), (40, 1)]
    q, cache, meta = make_batch(seqs, num_kv_heads=2, group=group, head_dim=32, dtype=torch.float32, seed=3)
    cache8 = (cache * 40).to(FP8)
    ks, vs = scale_tensor(0.03), scale_tensor(0.7)
    deq = cache8.float()
    deq[:, 0] *= 0.03
    deq[:, 1] *= 0.7
    want = paged_attention_ref(q, deq, meta, 0.2)
    torch.testing.assert_close(paged_attention_ref(q, cache8, meta, 0.2, ks, vs), want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(decode_attention_batched(q, cache8, meta, 0.2, ks, vs), want, **TOL[torch.float32])


# ------------------------------------------------------------------------------ Triton KV store

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary", [False, True])
def test_triton_store_fp8_matches_reference(dtype, rotary):
    """Out-of-order slots, padding rows (-1) untouched, saturation; with the rotary pass fused."""
    g = torch.Generator().manual_seed(5)
    num_blocks, block_size, num_tokens, num_heads, num_kv_heads, head_dim = 6, 4, 11, 8, 2, 64
    before = (torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=g) * 50).to(FP8).to(DEVICE)
    qkv = (torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g) * 4).to(dtype).to(DEVICE)
    qkv[3, num_heads * head_dim] = 1e4  # one k element past 448 * k_scale: saturates
    q, k, v = (x.view(num_tokens, -1, head_dim) for x in qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1))
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[0, 5, 10]] = -1
    slots = slots.to(DEVICE)
    ks, vs = scale_tensor(0.05), scale_tensor(0.013)
    cache, expected = before.clone(), before.clone()
    if rotary:
        rot = RotaryEmbedding(head_dim, 64, {"rope_type": "default", "rope_theta": 10000.0}).to(DEVICE)
        positions = torch.randint(0, 64, (num_tokens,), generator=g).to(DEVICE)
        # The kernel quantizes the fp32 rotation; the reference rotates in fp32 as well.
        store_kv_ref(apply_rotary(k.float(), positions, rot.cos_sin), v, expected, slots, ks, vs)
        store_kv(k, v, cache, slots, q, positions, rot.cos_sin, ks, vs)
    else:
        store_kv_ref(k, v, expected, slots, ks, vs)
        store_kv(k, v, cache, slots, k_scale=ks, v_scale=vs)
    assert cache.dtype == FP8
    same = cache.view(torch.uint8) == expected.view(torch.uint8)
    if rotary:
        # The rotation's multiply-adds may round differently in the last fp32 bit, which can move a
        # value across an e4m3 rounding midpoint: allow rare one-step differences.
        assert same.float().mean() > 0.99
        torch.testing.assert_close(cache.float(), expected.float(), atol=0, rtol=2 ** -3)
    else:
        assert torch.all(same)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    written[slots[slots >= 0]] = True
    untouched = (~written).view(num_blocks, block_size)
    assert torch.equal(cache.view(torch.uint8).permute(0, 2, 1, 3, 4)[untouched],
                       before.view(torch.uint8).permute(0, 2, 1, 3, 4)[untouched])
    # The saturated element: token 3's k head 0, element 0 (its slot holds +448 before any rotation).
    if not rotary:
        s = int(slots[3])
        assert cache[s // block_size, 0, s % block_size, 0, 0].float() == 448


def test_store_without_scales_is_scale_one():
    g = torch.Generator().manual_seed(6)
    k = (torch.randn(5, 2, 64, generator=g) * 30).to(DEVICE)
    v = (torch.randn(5, 2, 64, generator=g) * 30).to(DEVICE)
    slots = torch.tensor([3, 9, 0, 14, 7], device=DEVICE)
    a = torch.zeros(4, 2, 4, 2, 64, dtype=FP8, device=DEVICE)
    b = a.clone()
    store_kv(k, v, a, slots)
    store_kv(k, v, b, slots, k_scale=scale_tensor(1.0), v_scale=scale_tensor(1.0))
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    torch.testing.assert_close(a[0, 0, 3].double(), e4m3_quantize(k[0], 1.0), atol=0, rtol=0)


# --------------------------------------------------------------------------- Triton attention

def _fp8_batch(seqs, group, head_dim, dtype, seed, k_scale, v_scale, block_size=8):
    """make_batch's layout (shuffled blocks, garbage past each table row) with an FP8 cache that
    holds its random K / k_scale and V / v_scale (so the scaled values are about unit size, like
    the model-dtype tests' caches)."""
    q, cache, meta = make_batch(seqs, num_kv_heads=2, group=group, head_dim=head_dim, dtype=torch.float32,
                                block_size=block_size, seed=seed)
    cache8 = torch.stack([(cache[:, 0] / k_scale).to(FP8), (cache[:, 1] / v_scale).to(FP8)], dim=1)
    return q.to(dtype), cache8, meta, scale_tensor(k_scale), scale_tensor(v_scale)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4])
def test_ragged_fp8_matches_reference(scenario, dtype, group):
    q, cache8, meta, ks, vs = _fp8_batch(SCENARIOS[scenario], group, 64, dtype, seed=group, k_scale=0.021,
                                         v_scale=0.34)
    out = ragged_paged_attention(q, cache8, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                 meta.max_query_len, meta.max_seq_len, 0.125, k_scale=ks, v_scale=vs)
    assert out.dtype == dtype
    ref = paged_attention_ref(q, cache8, meta, 0.125, ks, vs)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    # The scales matter: without them the output is another one.
    assert not torch.allclose(out.float(), paged_attention_ref(q, cache8, meta, 0.125).float(), **TOL[dtype])


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_fp8_matches_reference(num_splits, dtype):
    seqs = [(150, 1), (1, 1), (33, 1), (97, 1)]
    q, cache8, meta, ks, vs = _fp8_batch(seqs, 4, 64, dtype, seed=num_splits, k_scale=0.05, v_scale=0.0061,
                                         block_size=16)
    out = paged_decode_attention(q, cache8, meta.seq_lens, meta.block_tables, meta.max_seq_len, 0.125,
                                 num_splits=num_splits, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out.float(), paged_attention_ref(q, cache8, meta, 0.125, ks, vs).float(), **TOL[dtype])


@pytest.mark.parametrize("scenario", ["mixed", "decode_only"])
def test_backends_agree_on_fp8_cache(scenario):
    """Store (with rotary) and attend in one forward, as the attention op calls it: the Triton
    backend vs the reference backend, both writing an FP8 cache with the layer's scales."""
    num_kv_heads, group, head_dim = 2, 3, 64
    q, cache8, meta, ks, vs = _fp8_batch(SCENARIOS[scenario], group, head_dim, torch.float32, seed=9,
                                         k_scale=0.02, v_scale=0.01)
    g = torch.Generator().manual_seed(10)
    k = (torch.randn(q.shape[0], num_kv_heads, head_dim, generator=g) * 2).to(DEVICE)
    v = torch.randn(q.shape[0], num_kv_heads, head_dim, generator=g).to(DEVICE)
    rot = RotaryEmbedding(head_dim, 256, {"rope_type": "default", "rope_theta": 10000.0}).to(DEVICE)
    positions = torch.randint(0, 256, (q.shape[0],), generator=g).to(DEVICE)
    ref_cache = cache8.clone()
    ref = TorchRefBackend().forward(q, k, v, ref_cache, meta, 0.125, positions, rot.cos_sin, k_scale=ks, v_scale=vs)
    if scenario == "decode_only":
        meta = TritonMetadata(**vars(meta), decode_num_splits=2)
    out = TritonBackend().forward(q, k, v, cache8, meta, 0.125, positions, rot.cos_sin, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(cache8.float(), ref_cache.float(), atol=0, rtol=2 ** -3)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("backend", [TorchRefBackend, TritonBackend])
def test_scales_are_ignored_for_a_model_dtype_cache(backend):
    q, cache, meta = make_batch(SCENARIOS["mixed"], num_kv_heads=1, group=2, head_dim=64, dtype=torch.float32,
                                seed=12)
    g = torch.Generator().manual_seed(13)
    k, v = (torch.randn(q.shape[0], 1, 64, generator=g).to(DEVICE) for _ in range(2))
    a, b = cache.clone(), cache.clone()
    out_a = backend().forward(q, k, v, a, meta, 0.125)
    out_b = backend().forward(q, k, v, b, meta, 0.125, k_scale=scale_tensor(3.0), v_scale=scale_tensor(0.1))
    assert torch.equal(out_a, out_b) and torch.equal(a, b)


# ------------------------------------------------------------------ scales from the checkpoint

@pytest.mark.parametrize("name,expected", [
    ("layers.3.self_attn.k_scale", [("layers.3.self_attn.attn", "k_scale")]),            # compressed-tensors
    ("layers.3.self_attn.v_scale", [("layers.3.self_attn.attn", "v_scale")]),
    ("layers.0.self_attn.k_proj.k_scale", [("layers.0.self_attn.attn", "k_scale")]),     # ModelOpt
    ("layers.0.self_attn.v_proj.v_scale", [("layers.0.self_attn.attn", "v_scale")]),
    ("layers.1.self_attn.k_proj.output_scale", [("layers.1.self_attn.attn", "k_scale")]),  # older c-t
    ("layers.1.self_attn.v_proj.output_scale", [("layers.1.self_attn.attn", "v_scale")]),
    ("layers.2.self_attn.kv_scale", [("layers.2.self_attn.attn", "k_scale"), ("layers.2.self_attn.attn", "v_scale")]),
    ("layers.2.self_attn.attn.k_scale", [("layers.2.self_attn.attn", "k_scale")]),
    ("layers.2.self_attn.k_proj.weight", []), ("layers.2.self_attn.k_proj.weight_scale", []),
    ("layers.2.self_attn.q_proj.output_scale", []), ("layers.2.mlp.k_scale", []),
])
def test_kv_scale_names(name, expected):
    assert kv_scale_targets(name) == expected


def _tiny_llama():
    from transformers import LlamaConfig

    from splitserve.models.decoder import LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def test_llama_loads_kv_scales_into_its_attention_layers():
    model = _tiny_llama()
    loaded = model.load_weights([
        ("model.layers.0.self_attn.k_scale", torch.tensor(0.25)),
        ("model.layers.0.self_attn.v_scale", torch.tensor([0.5], dtype=torch.bfloat16)),
        ("model.layers.1.self_attn.k_proj.output_scale", torch.tensor([[0.125]])),
        ("model.layers.1.self_attn.v_proj.v_scale", torch.tensor(2.0)),
        # layer 2: no scales in the checkpoint
    ])
    assert loaded == set()  # buffers, not parameters: the loader's missing-weights check is unaffected
    scales = [(layer.self_attn.attn.k_scale.item(), layer.self_attn.attn.v_scale.item()) for layer in model.layers]
    assert scales == [(0.25, 0.5), (0.125, 2.0), (1.0, 1.0)]
    attn = model.layers[0].self_attn.attn
    assert attn.k_scale.dtype == torch.float32 and attn.k_scale.shape == (1,)


@pytest.mark.parametrize("name,tensor,match", [
    ("model.layers.0.self_attn.k_scale", torch.ones(2), "one per-tensor value"),
    ("model.layers.0.self_attn.v_scale", torch.tensor(0.0), "positive finite"),
    ("model.layers.0.self_attn.kv_scale", torch.tensor(float("nan")), "positive finite"),
    ("model.layers.7.self_attn.k_scale", torch.tensor(1.0), "no attention layer layers.7"),
])
def test_bad_kv_scales_are_clear_errors(name, tensor, match):
    with pytest.raises(ValueError, match=match):
        _tiny_llama().load_weights([(name, tensor)])


def test_attention_scale_buffers_are_fp32_under_a_bf16_default():
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as load_model builds a bf16 model
    try:
        attn = Attention(0, 4, 2, 16, 0.25)
    finally:
        torch.set_default_dtype(prev)
    attn.load_kv_scale("k_scale", torch.tensor(0.0123, dtype=torch.float64))
    assert attn.k_scale.dtype == torch.float32 and attn.k_scale.item() == pytest.approx(0.0123, rel=1e-7)
