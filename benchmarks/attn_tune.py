"""Tile configurations of the paged-attention kernels on the device, per batch shape.

    python benchmarks/attn_tune.py            # ragged kernel; Llama-3-8B attention: 32 q heads, 8 KV heads, D 128, bf16
    python benchmarks/attn_tune.py --decode   # split-K decode kernel: (BLOCK_N, warps, stages), TB/s of K/V reads,
                                              # timed inside CUDA graphs
    add --default-only to time just the configuration the engine uses (A/B runs of two checkouts)

For each shape: every (BLOCK_M rows, BLOCK_N, warps, stages) variant is checked against torch_ref on
fresh random inputs, then timed (CUDA events, median); prints TFLOP/s per variant and the best.
"""
from __future__ import annotations

import itertools
import os
import sys

import torch
import triton

from splitserve.attention.backend import AttentionMetadata
from splitserve.attention.torch_ref import paged_attention_ref
from splitserve.kernels.attention import paged_attention as pa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_step import capture_graph  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16
SHAPES = {  # name: list of (prefix_len, query_len) per sequence
    "prefill 8x2048": [(0, 2048)] * 8,
    "prefill 16x512": [(0, 512)] * 16,
    "chunk 2048 on 4k prefix": [(4096, 2048)],
    "1k prefill + 64 decodes": [(0, 1024)] + [(300, 1)] * 64,
}


def make(seqs, dtype=torch.bfloat16):
    dev = "cuda"
    seq_lens = [p + q for p, q in seqs]
    blocks_per = [triton.cdiv(s, BS) for s in seq_lens]
    num_blocks = sum(blocks_per) + 8
    gen = torch.Generator(device=dev).manual_seed(0)
    cache = torch.randn(num_blocks, 2, BS, HKV, D, dtype=dtype, device=dev, generator=gen)
    perm = torch.randperm(num_blocks - 1, device=dev, generator=gen).int() + 1
    width = max(blocks_per)
    table = torch.zeros(len(seqs), width, dtype=torch.int32, device=dev)
    off = 0
    for i, nb in enumerate(blocks_per):
        table[i, :nb] = perm[off:off + nb]
        off += nb
    qlens = [q for _, q in seqs]
    qsl = torch.tensor([0] + list(itertools.accumulate(qlens)), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), HQ, D, dtype=dtype, device=dev, generator=gen)
    meta = AttentionMetadata(slot_mapping=torch.empty(0), query_start_loc=qsl.to(dev),
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev), block_tables=table,
                             max_query_len=max(qlens), max_seq_len=max(seq_lens), query_start_loc_cpu=qsl,
                             seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32))
    flops = sum(4 * q_len * (p + (q_len + 1) / 2) * HQ * D for p, q_len in seqs)
    return q, cache, meta, flops


def run(q, cache, meta):
    return pa.ragged_paged_attention(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                     meta.max_query_len, meta.max_seq_len, D ** -0.5)


DECODE_SHAPES = {  # name: (sequences, context range, split count or None for the default)
    "1024 seqs x ~190 (128/128)": (1024, (150, 230), None),
    "360 seqs x ~1100 (1024/128)": (360, (1030, 1160), None),
    "2 seqs x 200 (batch-1 graph)": (2, (200, 201), 16),
    "8 seqs x 4k": (8, (4000, 4096), None),
}


def graph_ms(fn, calls: int = 10) -> float:
    """Median GPU time of one call, from replays of a CUDA graph of `calls` calls (as a decode graph
    runs them: no launch overhead in the figure)."""
    g = capture_graph(lambda: [fn() for _ in range(calls)])
    return triton.testing.do_bench(g.replay, warmup=10, rep=100, return_mode="median") / calls


def decode_main() -> None:
    default = pa._decode_config
    variants = [None] + [(n, w, s) for n in (16, 32, 64, 128) for w in (2, 4, 8) for s in (2, 3, 4)]
    if "--default-only" in sys.argv:
        variants = [None]
    gen = torch.Generator().manual_seed(0)
    for name, (num_seqs, (lo, hi), splits) in DECODE_SHAPES.items():
        lens = torch.randint(lo, hi, (num_seqs,), generator=gen).tolist()
        q, cache, meta, _ = make([(n - 1, 1) for n in lens])
        ref = paged_attention_ref(q, cache, meta, D ** -0.5).float()
        kv_bytes = sum(lens) * HKV * D * 2 * q.element_size()
        rows = []
        for var in variants:
            pa._decode_config = default if var is None else (lambda head_dim, var=var: var)
            try:
                def go():
                    return pa.paged_decode_attention(q, cache, meta.seq_lens, meta.block_tables, 4096, D ** -0.5,
                                                     num_splits=splits)
                err = ((go().float() - ref).norm() / ref.norm()).item()
                ms = graph_ms(go)
            except Exception as e:  # out of shared memory etc.
                print(f"{name:30s} {str(var):14s} failed: {type(e).__name__}")
                continue
            rows.append((ms, var, err))
            print(f"{name:30s} {str(var):14s} {ms * 1e3:8.1f} us {kv_bytes / ms / 1e9:6.2f} TB/s  rel err {err:.1e}")
        pa._decode_config = default
        rows.sort(key=lambda r: r[0])
        base = next(r for r in rows if r[1] is None)
        print(f"BEST {name:30s} default {base[0] * 1e3:8.1f} us | best {str(rows[0][1]):16s} {rows[0][0] * 1e3:8.1f} us "
              f"({base[0] / rows[0][0]:.2f}x, {kv_bytes / rows[0][0] / 1e9:.2f} TB/s), rel err {rows[0][2]:.1e}")
        for ms, var, _ in rows[:5]:
            print(f"     top: {str(var):14s} {ms * 1e3:8.1f} us")


def main() -> None:
    if "--decode" in sys.argv:
        return decode_main()
    default = pa._ragged_config
    variants = [None] + [(m, n, w, s) for m in (64, 128) for n in (32, 64) for w in (4, 8) for s in (2, 3)]
    if "--default-only" in sys.argv:
        variants = [None]
    results = {}
    for name, seqs in SHAPES.items():
        q, cache, meta, flops = make(seqs)
        ref = paged_attention_ref(q, cache, meta, D ** -0.5).float()
        for var in variants:
            if var is None:
                pa._ragged_config = default
            else:
                m, n, w, s = var

                def cfg(group_pad, head_dim, max_query_len, mixed=False, m=m, n=n, w=w, s=s):
                    block_q = max(1, min(m // group_pad, triton.next_power_of_2(max(1, max_query_len))))
                    return max(block_q, triton.cdiv(16, group_pad)), n, w, s
                pa._ragged_config = cfg
            try:
                out = run(q, cache, meta).float()
                err = ((out - ref).norm() / ref.norm()).item()
                ms = triton.testing.do_bench(lambda: run(q, cache, meta), warmup=25, rep=100, return_mode="median")
            except Exception as e:  # out of shared memory etc.
                print(f"{name:28s} {str(var):22s} failed: {type(e).__name__}")
                continue
            results.setdefault(name, []).append((ms, var, err))
            print(f"{name:28s} {str(var):22s} {ms * 1e3:8.1f} us {flops / ms / 1e9:7.1f} TFLOP/s  rel err {err:.1e}")
    pa._ragged_config = default
    print("\nbest per shape (variant = BLOCK_M rows, BLOCK_N, warps, stages; None = current default):")
    for name, rows in results.items():
        rows.sort(key=lambda r: r[0])
        base = next(r for r in rows if r[1] is None)
        ms, var, err = rows[0]
        print(f"{name:28s} default {base[0] * 1e3:8.1f} us | best {str(var):22s} {ms * 1e3:8.1f} us "
              f"({base[0] / ms:.2f}x), rel err {err:.1e}")


if __name__ == "__main__":
    main()
