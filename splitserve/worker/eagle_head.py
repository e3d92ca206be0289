"""Speculative decoding with an EAGLE / EAGLE-3 head (models/eagle.py): drafts from the target's
hidden states.

KV: like the draft model (worker/draft_model.py, whose cache handling this class inherits), the
head's one layer has a cache tensor with the target's block count and block size, on the target's
block tables. Its entry at position p is computed from (token p + 1, the target's feature at p), so
it can only be written once token p + 1 is known: at collect, not at launch.

Per step:
- launch (`keep`): the target runs eagerly or piecewise (never the decode graphs, which give logits
  only) and hands out its features of every token of the step: the final hidden states (EAGLE), or
  the streams entering the head's auxiliary layers, concatenated (EAGLE-3: the runner's forward goes
  through `target_forward`). Kept on the step, with each scheduled sequence's start and count.
- collect (`fill_and_propose`, after the step's tokens are recorded): one head forward over every
  scheduled sequence's *verified* positions of the step (rejected drafts left out; a prompt chunk's
  positions all), tokens shifted by one, writing the head's cache there. Every step does this, also
  one that proposes nothing, so the head's cache is whole wherever the target's is (prefix-cache hits
  reuse what the request that filled the block wrote; its last position's entry may have been made
  with another next token, which costs acceptance, never correctness).
- Proposing: the fill's output at a sequence's last verified position gives draft 1; k - 1 one-token
  forwards at positions P .. P + k - 2 (P: the last known token's) feed back the head's own output as
  the feature and give drafts 2..k (on CUDA replaying decode graphs of their own, `HeadGraphs`).
  Those writes land in the request's k lookahead slots and are rewritten by the next fill. Greedy drafts are the argmax; a sampled request's come from q, the
  head's distribution under the request's sampling parameters, mapped from the draft vocabulary to
  the target's (zero elsewhere), kept for the exact verification (`draft_probs`, inherited).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from splitserve.attention.backend import AttentionMetadata
from splitserve.attention.layer import ForwardContext, forward_context
from splitserve.models.eagle import EagleHead, target_forward_with_aux
from splitserve.worker.cuda_graphs import DecodeGraphs
from splitserve.worker.draft_model import DraftModelProposer
from splitserve.worker.input_batch import CachedRequestState, InputBatch
from splitserve.worker.sampling_metadata import build_sampling_metadata


@dataclass
class EagleStep:
    """What a launched step keeps for the head: every scheduled sequence's state, first computed
    position, token count and first flat row, and the target's features of the step's tokens."""
    states: list[CachedRequestState]
    starts: np.ndarray
    counts: np.ndarray
    flat_start: np.ndarray
    features: torch.Tensor


def _metadata(rows_tables: np.ndarray, starts: np.ndarray, counts: np.ndarray, limits: np.ndarray, bs: int,
              dev) -> tuple[AttentionMetadata, np.ndarray]:
    """Attention metadata of `counts[i]` tokens of sequence i from position starts[i] (block table
    rows_tables[i]); a position at or past limits[i] (the slots the request holds) stores nothing and
    reads within bounds. Returns it and the flat positions."""
    S, width = rows_tables.shape
    qsl = np.zeros(S + 1, dtype=np.int32)
    np.cumsum(counts, out=qsl[1:])
    seq = np.repeat(np.arange(S), counts)
    pos = starts[seq] + (np.arange(int(qsl[-1])) - qsl[:-1][seq])
    block = rows_tables[seq, np.minimum(pos // bs, width - 1)].astype(np.int64)
    slots = np.where(pos < np.minimum(limits[seq], width * bs), block * bs + pos % bs, -1)
    seq_lens = np.minimum(starts + counts, width * bs).astype(np.int32)
    qsl_t, lens_t = torch.from_numpy(qsl), torch.from_numpy(seq_lens)
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(dev), query_start_loc=qsl_t.to(dev), seq_lens=lens_t.to(dev),
        block_tables=torch.from_numpy(np.ascontiguousarray(rows_tables)).to(dev), max_query_len=int(counts.max()),
        max_seq_len=int(seq_lens.max()), query_start_loc_cpu=qsl_t, seq_lens_cpu=lens_t)
    return meta, pos


class HeadGraphs(DecodeGraphs):
    """Decode graphs of the head's one-token proposal forwards: the feature fed back is one more
    static input, and the graph writes the draft-vocabulary logits and the next feature."""

    def __init__(self, head: EagleHead, *args, **kwargs):
        super().__init__(head, *args, **kwargs)
        with torch.inference_mode():
            self.feature = torch.zeros(self.max_size, head.hidden_size, dtype=head.fc.params_dtype,
                                       device=self.input_ids.device)
        self.fed: torch.Tensor | None = None

    def _forward(self, bs: int) -> None:
        meta = self.backend.capture_metadata(self.attn_state, bs)
        with forward_context(ForwardContext(meta, self.backend)):
            x, fed = self.model(self.input_ids[:bs], self.positions[:bs], self.feature[:bs])
        logits = self.model.compute_logits(x)
        if self.logits is None:  # the first (uncaptured) run: the buffers' sizes
            self.logits = logits.new_empty(self.max_size, logits.shape[1])
            self.fed = fed.new_empty(self.max_size, fed.shape[1])
        self.logits[:bs].copy_(logits)
        self.fed[:bs].copy_(fed)

    def run_head(self, n: int, tokens, positions, meta, feature) -> tuple[torch.Tensor, torch.Tensor]:
        self.feature[:n].copy_(feature)
        return self.run(n, tokens, positions, meta), self.fed[:n]


class EagleProposer(DraftModelProposer):
    uses_target_hidden = True  # the runner keeps the target's features of every step (model_runner)

    def __init__(self, head: EagleHead, k: int, block_size: int, max_blocks_per_seq: int, backend,
                 kv_cache_dtype: torch.dtype, device: torch.device, vocab_size: int):
        super().__init__(head, head.info.config, k, block_size, max_blocks_per_seq, backend, kv_cache_dtype, device)
        self.head, self.vocab_size = head, vocab_size
        self.aux_layers = head.info.aux_layers if head.eagle3 else ()
        self._features: torch.Tensor | None = None

    # -- the target's side -----------------------------------------------------------------------------
    def target_forward(self, model, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The target's eager forward (in the step's forward context), keeping EAGLE-3's streams."""
        if not self.aux_layers:
            return model(input_ids, positions)
        hidden, aux = target_forward_with_aux(model, input_ids, positions, self.aux_layers)
        self._features = torch.cat(aux, dim=-1)
        return hidden

    def graph_features(self, model, input_ids: torch.Tensor, positions: torch.Tensor):
        """What the decode graphs run instead of the model: (hidden states, the head's features)."""
        if not self.aux_layers:
            hidden = model(input_ids, positions)
            return hidden, hidden
        hidden, aux = target_forward_with_aux(model, input_ids, positions, self.aux_layers)
        return hidden, torch.cat(aux, dim=-1)

    def saw(self, hidden: torch.Tensor | None, features: torch.Tensor | None) -> None:
        """The step's features: given by a graph (copied: its buffers are reused), else the final
        hidden states (EAGLE), else what `target_forward` kept (EAGLE-3, eager)."""
        if features is not None:
            self._features = features.clone()
        elif not self.aux_layers:
            self._features = hidden.clone()

    def keep(self, ib: InputBatch, sched, batch) -> EagleStep:
        rows = ib.rows_of(sched.num_scheduled_tokens)
        qsl = batch.meta.query_start_loc_cpu.numpy().astype(np.int64)
        counts = np.diff(qsl)
        starts = batch.meta.seq_lens_cpu.numpy().astype(np.int64) - counts
        features, self._features = self._features, None
        assert features is not None and features.shape[0] == int(qsl[-1]), "the target's features of the step"
        return EagleStep([ib.row_states[r] for r in rows.tolist()], starts, counts, qsl[:-1], features)

    # -- the draft model's hooks -----------------------------------------------------------------------
    @torch.inference_mode()
    def run_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Warm-up only (steps keep features instead): the head's layer over the layout, zero features."""
        with forward_context(ForwardContext(meta, self.backend)):
            self.head(input_ids, positions, torch.zeros(input_ids.shape[0], self.head.hidden_size,
                                                        dtype=self.head.fc.params_dtype, device=input_ids.device))

    def setup_graphs(self, sizes: list[int], max_model_len: int, pool=None, stream=None,
                     use_graphs: bool = True) -> None:
        """Graphs of the proposal forwards (use_graphs=False: the same buffers run eagerly, tests)."""
        self.graphs = HeadGraphs(self.head, self.backend, sizes, self.max_blocks_per_seq, max_model_len,
                                 self.num_kv_heads, self.device, use_graphs=use_graphs)
        if use_graphs:
            self.graphs.capture(pool, stream)

    def propose(self, ib: InputBatch, states) -> dict[str, list[int]]:
        return {}  # drafts come from fill_and_propose, once the step's head inputs are complete

    # -- collect ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def fill_and_propose(self, ib: InputBatch, step, propose: bool) -> dict[str, list[int]]:
        """The head's cache over the step's verified positions; then, when the step proposes, k
        drafts for each of its sampling sequences that may speculate."""
        inp: EagleStep = step.eagle
        step.eagle = None
        rejected: dict[str, int] = {}
        if step.verify is not None:
            accepted = step.host[4].tolist()
            rejected = {s.req_id: len(d) - m for s, d, m in zip(step.sample_requests, step.drafts, accepted)}
        sel, rows, n = [], [], []
        for i, state in enumerate(inp.states):
            row = state.row
            if row < 0:  # left the batch
                continue
            # positions whose next token is known: all but rejected drafts
            m = min(int(inp.counts[i]) - rejected.get(state.req_id, 0), int(ib.num_known[row]) - 1 - int(inp.starts[i]))
            if m > 0:
                sel.append(i)
                rows.append(row)
                n.append(m)
        if not sel:
            return {}
        sel_a, rows_a, n_a = np.array(sel), np.array(rows, dtype=np.int64), np.array(n, dtype=np.int64)
        starts = inp.starts[sel_a]
        bs, dev = self.block_size, self.device
        width = min(self.max_blocks_per_seq, -(-int((starts + n_a).max()) // bs))
        meta, pos = _metadata(ib.block_table[rows_a, :width], starts, n_a, ib.num_blocks[rows_a] * bs, bs, dev)
        seq = np.repeat(np.arange(len(sel)), n_a)
        tokens = ib.token_ids[rows_a[seq], pos + 1].astype(np.int64)
        flat = inp.flat_start[sel_a][seq] + (pos - starts[seq])
        feats = inp.features[torch.from_numpy(flat).to(dev)]
        with forward_context(ForwardContext(meta, self.backend)):
            out, fed_back = self.head(torch.from_numpy(tokens).to(dev), torch.from_numpy(pos).to(dev), feats)
        if not propose:
            return {}
        last = {inp.states[i].req_id: int(e) - 1 for i, e in zip(sel, np.cumsum(n_a))}
        states = [s for s in step.sample_requests
                  if s.row >= 0 and s.sampling_params.allows_speculation and s.req_id in last]
        if not states:
            return {}
        idx = torch.tensor([last[s.req_id] for s in states], device=dev)
        return self._draft(ib, states, out[idx], fed_back[idx])

    def _draft(self, ib: InputBatch, states: list[CachedRequestState], x: torch.Tensor,
               feature: torch.Tensor) -> dict[str, list[int]]:
        bs, k, dev = self.block_size, self.k, self.device
        rows = np.array([s.row for s in states], dtype=np.int64)
        S = len(rows)
        P = ib.num_known[rows] - 1  # the last known token's position: the first one-token forward's
        width = min(self.max_blocks_per_seq, -(-int(P.max() + k) // bs))
        tables = ib.block_table[rows, :width]
        limits = ib.num_blocks[rows] * bs
        meta_s = build_sampling_metadata(ib, rows, states, P + 1 - ib.num_prompt[rows], dev)
        meta_s.max_num_logprobs = None
        to_target = self.head.draft_to_target
        out, qs = [], []
        logits = self.head.compute_logits(x)
        for j in range(k):
            if to_target is not None and not meta_s.all_greedy:
                full = logits.new_full((S, self.vocab_size), float("-inf"))  # the target's vocabulary:
                full[:, to_target] = logits                                  # -inf where the head has none
                logits = full
            tokens, q = self.draw(logits, meta_s, dev)
            if q is not None:
                qs.append(q)
            elif to_target is not None:
                tokens = to_target[tokens]  # greedy over the draft vocabulary
            out.append(tokens)
            if j == k - 1:
                break
            meta, _ = _metadata(tables, P + j, np.ones(S, dtype=np.int64), limits, bs, dev)
            positions = torch.from_numpy(np.minimum(P + j, ib.token_ids.shape[1] - 2)).to(dev)
            if self.graphs is not None and self.graphs.padded_size(S) is not None:
                logits, feature = self.graphs.run_head(S, tokens, positions, meta, feature)
            else:
                with forward_context(ForwardContext(meta, self.backend)):
                    x, feature = self.head(tokens, positions, feature)
                logits = self.head.compute_logits(x)
        drafts = torch.stack(out, 1).tolist()
        if qs:
            q_all = torch.stack(qs, 1)  # [S, k, V]
            for i, state in enumerate(states):
                if not state.sampling_params.greedy:
                    self._q[state.req_id] = (drafts[i], q_all[i])
        return {s.req_id: d for s, d in zip(states, drafts)}
