"""Speculative decoding with a draft model: a small model sharing the target's tokenizer, in the same
worker, proposing k tokens per sequence autoregressively.

KV: the draft has a cache tensor per layer of its own, with the target's block count and block size,
and uses the target's block tables: block b holds the target's K/V in the target's tensors and the
draft's K/V of the same tokens in the draft's. The draft runs over every step's inputs with the step's
own attention metadata (`run_step`), so its cache is always filled wherever the target's is, prefix-
cache hits included (a cached block was filled by a step where both ran).

Proposing (`propose`, at collect, when the step's tokens are known on the host): for each sampling
sequence that may speculate, k one-token forwards from its last known token at position P (its
computed count): forward j writes the draft's K/V at P + j and gives draft j + 1. The scheduler keeps
`lookahead_slots` (k) slots beyond a step's tokens for exactly these writes; a position past the
request's blocks (its context's end) writes nowhere (slot -1), and drafts from there are never
scheduled (the scheduler caps drafts by the context). A greedy request's drafts are the draft's
argmax; a sampled request's are drawn from q, the draft's distribution under the request's own
sampling parameters, and q is kept for the exact verification (`draft_probs`).

On CUDA (the runner's fast path) the draft's layers are compiled like the target's and its proposal
forwards (one token per sequence) replay decode CUDA graphs of their own (`setup_fast_path`); the
forward over a step's inputs runs the compiled layers without graphs.
"""
from __future__ import annotations

import numpy as np
import torch

from splitserve.attention.backend import AttentionMetadata
from splitserve.attention.layer import Attention, ForwardContext, forward_context
from splitserve.layers.rejection_sampler import VerifyLayout
from splitserve.layers.sampler import Sampler
from splitserve.worker.cuda_graphs import DecodeGraphs
from splitserve.worker.input_batch import CachedRequestState, InputBatch
from splitserve.worker.sampling_metadata import build_sampling_metadata


class DraftModelProposer:
    def __init__(self, model: torch.nn.Module, hf_config, k: int, block_size: int, max_blocks_per_seq: int,
                 backend, kv_cache_dtype: torch.dtype, device: torch.device):
        self.model, self.k, self.block_size = model, k, block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.backend, self.kv_cache_dtype, self.device = backend, kv_cache_dtype, device
        self.layers = [m for m in model.modules() if isinstance(m, Attention)]
        c = hf_config
        self.num_kv_heads = self.layers[0].num_kv_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.sampler = Sampler()
        self.graphs: DecodeGraphs | None = None  # proposal forwards' decode graphs (CUDA)
        # Sampled requests' drafts and their q ([k, V] on the device), until verified or gone.
        self._q: dict[str, tuple[list[int], torch.Tensor]] = {}

    # -- KV cache --------------------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * elem * len(self.layers)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = (num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim)
        for layer in self.layers:
            layer.kv_cache = torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)

    def setup_graphs(self, sizes: list[int], max_model_len: int, pool=None, stream=None,
                     use_graphs: bool = True) -> None:
        """Decode graphs for the proposal forwards (use_graphs=False: the same buffers and hooks run
        eagerly, for CPU tests of the plumbing)."""
        self.graphs = DecodeGraphs(self.model, self.backend, sizes, self.max_blocks_per_seq, max_model_len,
                                   self.num_kv_heads, self.device, use_graphs=use_graphs)
        if use_graphs:
            self.graphs.capture(pool, stream)

    # -- one step --------------------------------------------------------------------------------------
    def forget(self, req_ids) -> None:
        for rid in req_ids:
            self._q.pop(rid, None)

    @torch.inference_mode()
    def run_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """The draft over the step's inputs (same tokens, positions and slots as the target): fills its
        cache where the step fills the target's."""
        with forward_context(ForwardContext(meta, self.backend)):
            self.model(input_ids, positions)

    def draft_probs(self, states: list[CachedRequestState], drafts: list[list[int]], layout: VerifyLayout,
                    vocab: int) -> torch.Tensor | None:
        """q of each verify row with a draft ([R, V]; zero rows elsewhere), None when no sampled
        request verifies (greedy rows ignore q)."""
        rows = []
        for state, d, start in zip(states, drafts, layout.row_start.tolist()):
            if d and not state.sampling_params.greedy:
                kept, q = self._q.pop(state.req_id)
                assert kept[:len(d)] == d, "verifying drafts other than the ones proposed"
                rows.append((start, q[:len(d)]))
        if not rows:
            return None
        out = torch.zeros(layout.num_rows, vocab, device=self.device)
        for start, q in rows:
            out[start:start + len(q), :q.shape[1]] = q
        return out

    def draw(self, logits: torch.Tensor, meta_s, dev) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft token per row: the argmax for greedy rows, a draw from the row's processed
        distribution q otherwise (q returned for the rejection sampler; None when all are greedy)."""
        if meta_s.all_greedy:
            return logits.argmax(dim=-1), None
        processed, _ = self.sampler.process(logits, meta_s)
        q = self.sampler.probs(processed, meta_s)
        q = q / q.sum(dim=-1, keepdim=True)
        return torch.where(torch.from_numpy(meta_s.greedy).to(dev), processed.argmax(dim=-1),
                           self.sampler.race(q, meta_s)), q

    @torch.inference_mode()
    def propose(self, ib: InputBatch, states: list[CachedRequestState]) -> dict[str, list[int]]:
        states = [s for s in states if s.row >= 0 and s.sampling_params.allows_speculation]
        if not states:
            return {}
        bs, k, dev = self.block_size, self.k, self.device
        rows = np.array([s.row for s in states], dtype=np.int64)
        S = len(rows)
        start = ib.num_known[rows] - 1  # the last known token's position: the first forward's
        tokens = torch.from_numpy(ib.token_ids[rows, start].astype(np.int64)).to(dev)
        width = min(self.max_blocks_per_seq, -(-int(start.max() + k) // bs))
        tables = ib.block_table[rows, :width]
        limit = ib.num_blocks[rows] * bs  # slots the request holds
        meta_s = build_sampling_metadata(ib, rows, states, start + 1 - ib.num_prompt[rows], dev)
        meta_s.max_num_logprobs = None
        query_start = torch.arange(S + 1, dtype=torch.int32)
        block_tables = torch.from_numpy(tables).to(dev)
        out, qs = [], []
        for j in range(k):
            pos = start + j
            inside = pos < np.minimum(limit, width * bs)
            block = tables[np.arange(S), np.minimum(pos // bs, width - 1)].astype(np.int64)
            slots = np.where(inside, block * bs + pos % bs, -1)
            # (past the context's end the drafts are garbage, never scheduled: keep the reads in bounds)
            seq_lens = torch.from_numpy(np.minimum(pos + 1, width * bs).astype(np.int32))
            meta = AttentionMetadata(
                slot_mapping=torch.from_numpy(slots).to(dev), query_start_loc=query_start.to(dev),
                seq_lens=seq_lens.to(dev), block_tables=block_tables, max_query_len=1,
                max_seq_len=int(seq_lens.max()), query_start_loc_cpu=query_start, seq_lens_cpu=seq_lens)
            positions = torch.from_numpy(np.minimum(pos, ib.token_ids.shape[1] - 2)).to(dev)
            if self.graphs is not None and self.graphs.padded_size(S) is not None:
                logits = self.graphs.run(S, tokens, positions, meta)
            else:
                with forward_context(ForwardContext(meta, self.backend)):
                    hidden = self.model(tokens, positions)
                logits = self.model.compute_logits(hidden)
            tokens, q = self.draw(logits, meta_s, dev)
            if q is not None:
                qs.append(q)
            out.append(tokens)
        drafts = torch.stack(out, 1).tolist()
        if qs:
            q_all = torch.stack(qs, 1)  # [S, k, V]
            for i, state in enumerate(states):
                if not state.sampling_params.greedy:
                    self._q[state.req_id] = (drafts[i], q_all[i])
        return {s.req_id: d for s, d in zip(states, drafts)}
