"""The attention-kernel precompile (startup/kernel_precompile.py) on CPU.

Children compile the engine's start-up attention launches from meta tensors into Triton's on-disk
cache for an sm_90 GPU (Triton ships ptxas, so no GPU is needed to compile). The engine later
launches the same kernels on real tensors; those launches must find every kernel in the cache.
Here the "real" launches run on CPU tensors in compile-only mode, and Triton's compilation listener
reports whether each was a cache hit. Runs in subprocesses: the kernel tests switch this process's
Triton to the interpreter, and compile-only mode patches Triton for good.
"""
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import sys, torch
from triton import knobs
from splitserve.startup import kernel_precompile as kp
dtype = getattr(torch, sys.argv[2])
kv_dtype = getattr(torch, sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] != "-" else None  # the KV cache's; None: dtype
# The layers' (sliding_window, soft_cap) pairs; default: plain layers only.
variants = eval(sys.argv[4]) if len(sys.argv) > 4 else ((None, None),)
head_dim = int(sys.argv[5]) if len(sys.argv) > 5 else 64
# A GQA shape (8 heads over 2 KV heads, head_dim 64), a 512-token budget, three decode graph sizes
# (16, 16 and 4 splits on 132 SMs; the warm-up's decode step has none): every kernel and variant the
# engine launches at start-up.
spec = kp.AttentionKernelSpec("triton", 8, 2, head_dim, dtype, 16, 512, 4096, (2, 4, 64), 132, 90, 64, kv_dtype,
                              variants)
if sys.argv[1] == "children":
    pre = kp.AttentionPrecompile(spec, num_workers=2)
    for p in pre.procs:
        p.join()
    print("exit codes", [p.exitcode for p in pre.procs])
else:
    seen = []
    knobs.compilation.listener = lambda src, metadata, metadata_group, times, cache_hit: seen.append(
        (src.fn.__name__, cache_hit))
    kp.compile_launches(spec, device=torch.device("cpu"))
    print("RESULT", seen)
"""


def _run(tmp_path, phase: str, dtype: str, kv_dtype: str | None = None, variants: str | None = None,
         head_dim: int = 64):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
    extra = [kv_dtype or "-", variants or "((None, None),)", str(head_dim)]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, phase, dtype, *extra], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _precompile_and_launch(tmp_path, kv_dtype: str | None = None) -> list:
    """The children's precompile for bf16 (plain layers) into tmp_path's cache, then the real
    launches against it: what they saw, (kernel name, cache hit) per compile."""
    assert "exit codes [0, 0]" in _run(tmp_path, "children", "bfloat16", kv_dtype)
    return eval(_run(tmp_path, "real", "bfloat16", kv_dtype).split("RESULT", 1)[1])


@pytest.fixture(scope="module")
def bf16_plain(tmp_path_factory):
    """(cache directory, real launches' list) of the plain bf16 precompile, which three tests start
    from: each compile for sm_90 takes tens of seconds on a CPU."""
    tmp_path = tmp_path_factory.mktemp("bf16-plain")
    return tmp_path, _precompile_and_launch(tmp_path)


# float8_e4m3fn: an FP8 KV cache, whose kernels (FP8 loads and stores) must also compile for sm_90.
@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
def test_precompiled_kernels_are_cache_hits_for_real_launches(request, tmp_path, kv_dtype):
    seen = request.getfixturevalue("bf16_plain")[1] if kv_dtype is None else _precompile_and_launch(tmp_path, kv_dtype)
    names = {name for name, _ in seen}
    # store, the ragged kernel's variants, decode with and without splits, and the split merge
    assert names == {"_store_kv_kernel", "_ragged_paged_attn_kernel", "_decode_split_kernel", "_decode_reduce_kernel"}
    assert sum(name == "_ragged_paged_attn_kernel" for name, _ in seen) >= 2
    assert all(hit for _, hit in seen), seen


def test_other_specialisations_miss_the_cache(tmp_path, bf16_plain):
    # The control: the listener does report misses. fp16 launches against a bf16 precompile miss
    # (a copy of the shared one: these launches add their own entries).
    shutil.copytree(bf16_plain[0], tmp_path, dirs_exist_ok=True)
    seen = eval(_run(tmp_path, "real", "float16").split("RESULT", 1)[1])
    assert seen and not any(hit for _, hit in seen), seen
    # So do launches on an FP8 cache against a bf16 one (the cache's dtype is part of the key).
    seen = eval(_run(tmp_path, "real", "bfloat16", "float8_e4m3fn").split("RESULT", 1)[1])
    assert seen and not any(hit for name, hit in seen if name != "_decode_reduce_kernel"), seen


def test_windowed_and_soft_capped_layers_are_precompiled(tmp_path, bf16_plain):
    """A model with plain, windowed (7: no divisibility specialisation; 4096: divisible by 16) and
    soft-capped layers: each kind's launches are compiled by the children and hit the cache."""
    variants = "((None, None), (7, None), (4096, 50.0))"
    assert "exit codes [0, 0]" in _run(tmp_path, "children", "bfloat16", None, variants)
    seen = eval(_run(tmp_path, "real", "bfloat16", None, variants).split("RESULT", 1)[1])
    plain = bf16_plain[1]  # a plain model's launches (the same kernels whether they hit or miss)
    # more ragged / decode variants than a plain model, all of them hits
    assert sum(n == "_ragged_paged_attn_kernel" for n, _ in seen) > sum(n == "_ragged_paged_attn_kernel" for n, _ in plain)
    assert all(hit for _, hit in seen), seen


def test_padded_head_dim_kernels_compile_for_sm90(tmp_path):
    """Head dim 96 (tiles padded to 128) with a window and a soft cap: every start-up kernel compiles
    for a real GPU target (the interpreter tests check the maths, not the GPU compiler), and the
    real launches hit the cache."""
    variants = "((None, None), (4096, 50.0))"
    assert "exit codes [0, 0]" in _run(tmp_path, "children", "bfloat16", None, variants, 96)
    seen = eval(_run(tmp_path, "real", "bfloat16", None, variants, 96).split("RESULT", 1)[1])
    assert seen and all(hit for _, hit in seen), seen


T5_SCRIPT = r"""
import sys, torch
from triton import knobs
from splitserve.startup import kernel_precompile as kp
from splitserve.attention.triton_backend import TritonBackend
# A T5-shaped decoder (8 heads of 64, no rotary): self-attention with a position bias, cross-attention
# over encoder inputs of up to 512 positions; decode graphs of 2, 4 and 64 sequences.
spec = kp.AttentionKernelSpec("triton", 8, 8, 64, torch.bfloat16, 16, 512, 4096, (2, 4, 64), 132, 90, 0,
                              pos_bias=True, cross_max_enc_len=512)
if sys.argv[1] == "children":
    pre = kp.AttentionPrecompile(spec, num_workers=2)
    for p in pre.procs:
        p.join()
    print("exit codes", [p.exitcode for p in pre.procs])
else:
    # The engine's own launches, as its decode graphs make them: the backend's graph hooks, a bias
    # table of the model's length, the cross state's bound.
    seen = []
    knobs.compilation.listener = lambda src, metadata, metadata_group, times, cache_hit: seen.append(
        (src.fn.__name__, src.constants, cache_hit))
    kp.compile_only_mode(spec.capability)
    backend, dev = TritonBackend(), torch.device("cpu")
    cache = torch.empty(64, 2, 16, 8, 64, dtype=torch.bfloat16)
    state = backend.decode_graph_state(64, 4096 // 16, 4096, 8, dev)
    cross = backend.cross_graph_state(64, 512 // 16, 16, dev)
    bias = torch.empty(8, 2049, dtype=torch.float32)
    for bs in (2, 4, 64):
        q = torch.empty(bs, 8, 64, dtype=torch.bfloat16)
        backend.attend(q, cache, backend.capture_metadata(state, bs), 0.125, pos_bias=bias)
        backend.cross_forward(q, cache, backend.capture_cross_metadata(cross, bs), 0.125)
    print("RESULT", [(name, hit) for name, constants, hit in seen if name != "_decode_reduce_kernel"])
"""


def test_t5_bias_and_cross_attention_are_precompiled(tmp_path):
    """A T5-style decoder's decode-graph launches (self-attention with the bias table, cross-attention
    at the cross state's bound) hit what the children compiled from the spec."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
    outs = []
    for phase in ("children", "real"):
        proc = subprocess.run([sys.executable, "-c", T5_SCRIPT, phase], env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append(proc.stdout)
    assert "exit codes [0, 0]" in outs[0]
    seen = eval(outs[1].split("RESULT", 1)[1])
    # compiled once each (later launches of a variant are in-process hits the listener does not see):
    # with the bias and without (cross), each with splits (2 sequences) and without (64)
    assert sum(name == "_decode_split_kernel" for name, _ in seen) == 4, seen
    assert all(hit for _, hit in seen), seen


def test_t5_decoder_attention_shape():
    from transformers import LlamaConfig, Pix2StructConfig, T5Config

    from splitserve.startup.kernel_precompile import t5_decoder_attention
    assert t5_decoder_attention(T5Config(num_heads=12, d_kv=64)) == (12, 12, 64)
    assert t5_decoder_attention(Pix2StructConfig().text_config) == (12, 12, 64)
    assert t5_decoder_attention(LlamaConfig()) is None
