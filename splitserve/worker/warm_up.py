"""What the fast path compiles at start-up: the decoder layers' halves (Inductor), whether a model
takes piecewise graphs, and the warm-up's step layouts, every query-length class of the attention
kernel run once so that compilation happens at start-up (ModelRunner._warm_up_eager,
startup/kernel_precompile.py)."""
from __future__ import annotations

import torch

from splitserve.attention.backend import AttentionMetadata
from splitserve.models.interfaces import capabilities_of


def warm_up_layouts(budget: int, block_size: int) -> list[tuple[int, int, int]]:
    """(sequences, query tokens each, context tokens each) of the start-up warm-up steps: every query
    length class of the attention kernel (powers of two up to its largest query block) and a long
    prefill, each fresh and with context before it (prefix hits, later chunks, decode rows in a mixed
    step), which picks other K/V tiles. No step of a single token: Inductor would specialise on it.
    tests/worker/test_warm_up.py checks they reach every kernel variant a step can pick."""
    layouts = []
    for q_len in sorted({1, 2, 4, 8, 16, 32, 64, min(budget, 512)}):
        num_seqs = max(1, min(budget, 256) // q_len) if q_len < 16 else 1
        if q_len <= budget and num_seqs * q_len > 1:
            layouts += [(num_seqs, q_len, 0), (num_seqs, q_len, block_size)]
    return layouts


def warm_up_batch(num_seqs: int, q_len: int, context: int, block_size: int,
                  device: torch.device) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata and positions of one warm-up step: num_seqs sequences of q_len new tokens after
    `context` tokens each. Slots are -1 (nothing is stored); every block table points at block 0."""
    total, seq_len = num_seqs * q_len, q_len + context
    meta = AttentionMetadata(
        slot_mapping=torch.full((total,), -1, dtype=torch.long, device=device),
        query_start_loc=torch.arange(0, total + 1, q_len, dtype=torch.int32, device=device),
        seq_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device),
        block_tables=torch.zeros(num_seqs, -(-seq_len // block_size), dtype=torch.int32, device=device),
        max_query_len=q_len, max_seq_len=seq_len,
        query_start_loc_cpu=torch.arange(0, total + 1, q_len, dtype=torch.int32),
        seq_lens_cpu=torch.full((num_seqs,), seq_len, dtype=torch.int32))
    positions = context + torch.arange(total, device=device) % q_len
    return meta, positions


def compile_decoder_layers(model: torch.nn.Module) -> None:
    """torch.compile (Inductor) of the batchful halves of each decoder layer, before and after its
    attention op. The token count is dynamic; all layers share one graph per half (same code,
    weights passed as inputs), so compilation happens once. Dynamic shapes specialise a size of 1:
    a one-token input compiles a second graph per half, which happens only where the decode graphs
    include batch size 1 (ModelRunner.decode_graph_sizes): other one-token steps are padded (decode
    graphs of 2, piecewise buckets) and the warm-up runs none."""
    # Several engines in one process (tests, benchmarks) each add a graph or two; never fail on that.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for layer in model.layers:
        layer.attn_inputs = torch.compile(layer.attn_inputs, dynamic=True, fullgraph=True)
        layer.attn_outputs = torch.compile(layer.attn_outputs, dynamic=True, fullgraph=True)


def supports_piecewise(model: torch.nn.Module) -> bool:
    """Piecewise graphs need the text model's structure: embed + start, layers split at attention, norm
    (models/interfaces.SupportsPiecewise, checked once per model)."""
    return capabilities_of(model).piecewise
