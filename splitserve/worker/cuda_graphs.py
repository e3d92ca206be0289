"""Full-model CUDA graphs for pure-decode steps.

A decode step of B sequences is one token per sequence: its launch sequence depends only on B. We
capture the whole model (batchful layers, attention op, LM head) once per batch size in a list, with
every input read from static buffers, and replay the smallest graph that fits: padding rows get
slot -1 (not stored) and sequence length 0 (attention writes zeros), and their logits are ignored.
"""
from __future__ import annotations

import logging
import time

import torch

from splitserve.attention.backend import AttentionMetadata
from splitserve.attention.layer import ForwardContext, forward_context

logger = logging.getLogger(__name__)


class DecodeGraphs:
    def __init__(self, model, backend_factory, sizes: list[int], max_blocks_per_seq: int,
                 max_model_len: int, device: torch.device):
        self.model = model
        self.sizes = sorted(sizes)
        self.max_size = self.sizes[-1]
        self.max_model_len = max_model_len
        n, dev = self.max_size, device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.backend_factory = backend_factory  # batch size -> backend with a fixed decode grid
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[:bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs], max_query_len=1,
            max_seq_len=self.max_model_len, query_start_loc_cpu=torch.arange(bs + 1, dtype=torch.int32),
            seq_lens_cpu=torch.zeros(bs, dtype=torch.int32))

    def _forward(self, bs: int) -> torch.Tensor:
        ctx = ForwardContext(self._meta(bs), self.backend_factory(bs))
        with forward_context(ctx):
            hidden = self.model(self.input_ids[:bs], self.positions[:bs])
            return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: compile, autotune, allocate outside the graph
                    self._forward(bs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.logits[bs] = self._forward(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes %d..%d) in %.1f s",
                    len(self.sizes), self.sizes[0], self.max_size, time.perf_counter() - start)

    def padded_size(self, num_seqs: int) -> int | None:
        for bs in self.sizes:
            if bs >= num_seqs:
                return bs
        return None

    def run(self, num_seqs: int, input_ids, positions, slot_mapping, seq_lens, block_tables) -> torch.Tensor:
        """Copies the step's inputs (device tensors of num_seqs rows) into the static buffers, replays,
        and returns the logits of the real rows."""
        bs = self.padded_size(num_seqs)
        self.input_ids[:num_seqs].copy_(input_ids)
        self.positions[:num_seqs].copy_(positions)
        self.slot_mapping[:num_seqs].copy_(slot_mapping)
        self.seq_lens[:num_seqs].copy_(seq_lens)
        width = block_tables.shape[1]
        self.block_tables[:num_seqs, :width].copy_(block_tables)
        if bs > num_seqs:
            self.slot_mapping[num_seqs:bs].fill_(-1)
            self.seq_lens[num_seqs:bs].fill_(0)
        self.graphs[bs].replay()
        return self.logits[bs][:num_seqs]
