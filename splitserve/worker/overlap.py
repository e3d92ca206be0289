"""Two-batch overlap: one half of a mixed step attends while the other half's batchful layers run.

A mixed step with many decode rows spends a quarter of its time in their attention, which reads long
contexts from the KV cache (memory-bound: the tensor cores idle), while the GEMMs around it are
compute-bound (a few thousand tokens). Within one batch the layers' data dependencies serialise the
two, so such a step is cut at a sequence boundary into halves A and B, and each half's attention runs
on a side stream beside the other half's batchful segments:

    main:  pre A0 | pre B0  | post A0 + pre A1 | post B0 + pre B1 | post A1 + ...
    side:           attn A0 | attn B0          | attn A1          | attn B1 ...

`pre` is a layer's attention inputs (norm, QKV projection), `post` the rest of it (O projection,
norm, MLP). Every batchful layer treats rows independently, so the halves compute what the whole
step computes. The runner orders such a step's sequences so that each half gets half of the decode
rows (order_for_overlap).

The side stream lives in a green context of SIDE_SMS SMs. benchmarks/overlap_probe.py measured on
the H100 (one layer's GEMMs of 1,500 rows beside the decode attention of 180 sequences of 1,100
tokens): on a plain second stream the GEMMs hold every SM and almost nothing overlaps (1.33 vs 1.36
ms one after the other); with the attention confined to 48 SMs, 1.22 ms. Where green contexts are not
available, no step is cut.

Stream discipline: every side-stream launch first waits for everything the main stream has enqueued,
and the main stream waits for a half's attention before using its output. Tensors the main stream
allocated for the side (q, k, v) stay referenced until that wait, so the caching allocator cannot
hand their memory out while the side stream still reads it.
"""
from __future__ import annotations

import logging

import torch

from splitserve.attention.backend import AttentionMetadata
from splitserve.attention.layer import ForwardContext, forward_context
from splitserve.models.llama import start_residual

logger = logging.getLogger(__name__)

# SMs of the side stream's green context (see above): 48 was the best of 24/32/48/64 on that shape,
# 32 on a step of twice its size (2.39 vs 2.42 ms there, against 2.69 one after the other).
SIDE_SMS = 48


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


def order_for_overlap(scheduled: list, min_decodes: int) -> list | None:
    """A mixed step's (request, num_tokens) list reordered for two halves: half of the decode rows
    (one token each), the multi-token rows, the other half of the decode rows. None when the step
    is not mixed or has fewer than min_decodes decode rows: then there is little attention to hide."""
    decodes = [item for item in scheduled if item[1] == 1]
    if min_decodes <= 0 or len(decodes) < min_decodes or len(decodes) == len(scheduled):
        return None
    rest = [item for item in scheduled if item[1] != 1]
    half = len(decodes) // 2
    return decodes[:half] + rest + decodes[half:]


def balanced_split(query_start_loc: torch.Tensor) -> int | None:
    """The sequence index that cuts the step's tokens closest to two equal halves (host
    query_start_loc), or None when no cut leaves each half at least a quarter of them."""
    total, num_seqs = int(query_start_loc[-1]), query_start_loc.shape[0] - 1
    if num_seqs < 2:
        return None
    j = int(torch.searchsorted(query_start_loc, total // 2))
    j = min((c for c in (j - 1, j, j + 1) if 0 < c < num_seqs), key=lambda c: abs(2 * int(query_start_loc[c]) - total))
    t = int(query_start_loc[j])
    return j if min(t, total - t) * 4 >= total else None


def side_stream(device: torch.device) -> tuple[object, torch.cuda.Stream] | None:
    """(green context, its stream) for the halves' attention, or None where green contexts are not
    available (CUDA < 12.4, a torch without them, or not CUDA)."""
    green = getattr(torch.cuda, "green_contexts", None)
    if device.type != "cuda" or green is None or not getattr(green, "SUPPORTED", False):
        return None
    try:
        ctx = green.GreenContext.create(num_sms=SIDE_SMS, device_id=device.index or 0)
        return ctx, ctx.Stream()
    except RuntimeError as e:  # e.g. a driver without green contexts
        logger.info("no green context for two-batch overlap (%s); mixed steps run whole", e)
        return None


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
