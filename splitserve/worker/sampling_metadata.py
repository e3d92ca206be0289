"""Builds the sampler's per-row data for a step from the persistent batch.

Everything common is a numpy gather over the sampling rows; per-row Python runs only for the rows
that use a rare feature (penalties, min_tokens not reached yet, a seed, logit_bias, allowed tokens,
bad words), so a plain greedy step of 1,000 rows costs a few array operations. Those features
become flat arrays here, which the sampler applies in one operation each.
"""
from __future__ import annotations

import numpy as np
import torch

from splitserve.protocol.sched_output import GrammarBitmask
from splitserve.layers.sampling_metadata import BANNED, PenaltyRow, SamplingMetadata
from splitserve.worker.input_batch import CachedRequestState, InputBatch


def build_sampling_metadata(batch: InputBatch, rows: np.ndarray, states: list[CachedRequestState],
                            num_outputs_before: np.ndarray, device: torch.device,
                            grammar: GrammarBitmask | None = None) -> SamplingMetadata:
    """rows: the batch rows that sample, in logits order; states: their request states;
    num_outputs_before: output tokens each already has (pending ones included), for min_tokens;
    grammar: the step's bitmasks of constrained requests (all of them sample in this step)."""
    greedy = batch.greedy[rows]
    all_greedy = bool(greedy.all())
    max_logprobs = int(batch.num_logprobs[rows].max())
    meta = SamplingMetadata(len(rows), all_greedy, max_num_logprobs=None if max_logprobs < 0 else max_logprobs)
    if not all_greedy:
        meta.greedy = greedy
        meta.temperature = batch.temperature[rows]
        meta.top_k = batch.top_k[rows]
        meta.top_p = batch.top_p[rows]
        meta.min_p = batch.min_p[rows]
        for i in np.flatnonzero(batch.seeded[rows]).tolist():
            state = states[i]
            if state.generator is None:
                state.generator = torch.Generator(device=device).manual_seed(state.sampling_params.seed)
            meta.generators[i] = state.generator
    for i in np.flatnonzero(batch.penalties[rows]).tolist():
        state = states[i]
        p = state.sampling_params
        meta.penalties.append(PenaltyRow(i, p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
                                         state.prompt_token_ids, state.output_token_ids))
    _add_logit_changes(meta, batch, rows, states, num_outputs_before)
    if grammar is not None:
        # Sampling index of each batch row of this step, to place the constrained requests' masks.
        index = np.full(batch.max_num_reqs, -1, dtype=np.int64)
        index[rows] = np.arange(len(rows))
        grammar_rows = index[batch.rows_of(grammar.req_ids)]
        assert (grammar_rows >= 0).all(), "a constrained request does not sample in this step"
        meta.grammar_rows, meta.grammar_bitmask = grammar_rows, grammar.bitmask
    return meta


def _add_logit_changes(meta: SamplingMetadata, batch: InputBatch, rows: np.ndarray,
                       states: list[CachedRequestState], num_outputs_before: np.ndarray) -> None:
    """logit_bias, min_tokens and bad-word bans as one sparse (row, token, value) list; the allowed
    tokens of rows with allowed_token_ids as (row, token) pairs."""
    under_min = num_outputs_before < batch.min_tokens[rows]
    biased = batch.has_bias[rows] | under_min | batch.has_bad_seqs[rows]
    if biased.any():
        row_parts, id_parts, value_parts = [], [], []

        def add(i: int, ids: np.ndarray, values) -> None:
            row_parts.append(np.full(len(ids), i, dtype=np.int64))
            id_parts.append(ids)
            value_parts.append(np.broadcast_to(np.asarray(values, dtype=np.float32), ids.shape))

        for i in np.flatnonzero(biased).tolist():
            state = states[i]
            if state.bias_ids is not None:
                add(i, state.bias_ids, state.bias_values)
            if under_min[i]:
                add(i, state.min_tokens_bans, BANNED)
            if state.bad_word_seqs:
                meta.reads_history = True
                out = state.output_token_ids  # all known: steps that read them are collected first
                ids = [seq[-1] for seq in state.bad_word_seqs
                       if len(out) >= len(seq) - 1 and tuple(out[len(out) - len(seq) + 1:]) == seq[:-1]]
                if ids:
                    add(i, np.array(ids, dtype=np.int64), BANNED)
        if row_parts:
            meta.bias_rows = np.concatenate(row_parts)
            meta.bias_token_ids = np.concatenate(id_parts)
            meta.bias_values = np.concatenate(value_parts)
    allowed = np.flatnonzero(batch.has_allowed[rows])
    if len(allowed):
        ids = [states[i].allowed_ids for i in allowed.tolist()]
        meta.allowed_rows = np.repeat(allowed, [len(x) for x in ids])
        meta.allowed_token_ids = np.concatenate(ids)
