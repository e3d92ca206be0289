"""Two-batch overlap: one half of a step attends while the other half's batchful layers run.

Decode attention reads the KV cache (memory-bound: the tensor cores idle), while the GEMMs around it
are compute-bound once a step has a few hundred tokens. Within one batch the layers' data
dependencies serialise the two, so a large step is cut at a sequence boundary into halves A and B,
and each half's attention runs on a side stream beside the other half's batchful segments:

    main:  pre A0 | pre B0  | post A0 + pre A1 | post B0 + pre B1 | post A1 + ...
    side:           attn A0 | attn B0          | attn A1          | attn B1 ...

`pre` is a layer's attention inputs (norm, QKV projection), `post` the rest of it (O projection,
norm, MLP). Every batchful layer treats rows independently, so the halves compute what the whole
step computes. benchmarks/overlap_probe.py measured on the H100, inside a CUDA graph, 80-100% of the
decode attention hidden beside one layer's GEMMs of 500-3000 rows.

Stream discipline (eager and under graph capture alike): every side-stream launch first waits for
everything the main stream has enqueued, and the main stream waits for a half's attention before
using its output. Tensors the main stream allocated for the side (q, k, v) stay referenced until that
wait, so the caching allocator cannot hand their memory out while the side stream still reads it.
"""
from __future__ import annotations

import torch

from splitserve.attention.backend import AttentionMetadata
from splitserve.attention.layer import ForwardContext, forward_context
from splitserve.models.llama import start_residual


def split_metadata(meta: AttentionMetadata, j: int) -> tuple[AttentionMetadata, AttentionMetadata]:
    """The step's metadata cut before sequence j: sequences [0, j) and [j, B) with their tokens.
    The second half's device tensors are fresh copies: a slice at an odd offset would not be 16-byte
    aligned, and Triton compiles a separate kernel for an unaligned pointer."""
    qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    t = int(qsl[j])
    counts = qsl[1:] - qsl[:-1]

    def half(lo: int, hi: int, tok_lo: int, tok_hi: int, copy: bool) -> AttentionMetadata:
        fix = (lambda x: x.clone()) if copy else (lambda x: x)
        return AttentionMetadata(
            slot_mapping=fix(meta.slot_mapping[tok_lo:tok_hi]),
            query_start_loc=meta.query_start_loc[lo:hi + 1] - tok_lo if copy else meta.query_start_loc[lo:hi + 1],
            seq_lens=fix(meta.seq_lens[lo:hi]), block_tables=fix(meta.block_tables[lo:hi]),
            max_query_len=int(counts[lo:hi].max()), max_seq_len=int(lens[lo:hi].max()),
            query_start_loc_cpu=qsl[lo:hi + 1] - tok_lo, seq_lens_cpu=lens[lo:hi])
    return half(0, j, 0, t, False), half(j, meta.num_seqs, t, int(qsl[-1]), True)


def balanced_split(meta: AttentionMetadata, min_tokens: int) -> int | None:
    """The sequence index that cuts the step's tokens closest to two equal halves, or None when the
    step is too small to gain (fewer than min_tokens) or no cut leaves each half a quarter of it."""
    qsl = meta.query_start_loc_cpu
    total = int(qsl[-1])
    if min_tokens <= 0 or total < min_tokens or meta.num_seqs < 2:
        return None
    j = int(torch.searchsorted(qsl, total // 2))
    candidates = [c for c in (j - 1, j, j + 1) if 0 < c < meta.num_seqs]
    j = min(candidates, key=lambda c: abs(2 * int(qsl[c]) - total))
    t = int(qsl[j])
    return j if min(t, total - t) * 4 >= total else None


class _Half:
    """One half's progress through the layers: its residual stream and its attention in flight."""

    def __init__(self, ctx: ForwardContext, positions: torch.Tensor, side: torch.cuda.Stream | None):
        self.ctx, self.positions, self.side = ctx, positions, side
        self.residual: torch.Tensor | None = None
        self.attn_out: torch.Tensor | None = None
        self._inputs: tuple = ()
        self._done: torch.cuda.Event | None = None

    def attend(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.side is None:  # no side stream (CPU): in order
            with forward_context(self.ctx):
                self.attn_out = layer.self_attn.attn(q, k, v, self.positions)
            return
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side), forward_context(self.ctx):
            self.attn_out = layer.self_attn.attn(q, k, v, self.positions)
            self._done = torch.cuda.Event()
            self._done.record()
        self._inputs = (q, k, v)

    def join(self) -> torch.Tensor:
        if self._done is not None:
            torch.cuda.current_stream().wait_event(self._done)
            self._done, self._inputs = None, ()
        return self.attn_out


def overlapped_forward(model, input_ids: torch.Tensor, positions: torch.Tensor, split: int,
                       ctx_a: ForwardContext, ctx_b: ForwardContext,
                       side: torch.cuda.Stream | None) -> torch.Tensor:
    """Final hidden states [T, hidden] of a text model (embed, layers with attn_inputs/attn_outputs,
    norm) run as two halves, tokens [0, split) under ctx_a and [split, T) under ctx_b."""
    layers = model.layers
    # The second half's positions are copied for the same alignment reason as in split_metadata.
    halves = [_Half(ctx_a, positions[:split], side), _Half(ctx_b, positions[split:].clone(), side)]
    for h, ids in zip(halves, (input_ids[:split], input_ids[split:])):
        x = model.embed(ids)
        q, k, v, h.residual = layers[0].attn_inputs(x, start_residual(x))
        h.attend(layers[0], q, k, v)
    outs = []
    for i, layer in enumerate(layers):
        for h in halves:
            x, h.residual = layer.attn_outputs(h.join(), h.residual)
            if i + 1 < len(layers):
                q, k, v, h.residual = layers[i + 1].attn_inputs(x, h.residual)
                h.attend(layers[i + 1], q, k, v)
            else:
                outs.append(model.norm(x, h.residual)[0])
    return torch.cat(outs)
