"""Builds the sampler's per-row data for a step from the persistent batch.

Everything common is a numpy gather over the sampling rows; per-row Python runs only for the rows
that use a rare feature (penalties, min_tokens not reached yet, a seed), so a plain greedy step of
1,000 rows costs a few array operations.
"""
from __future__ import annotations

import numpy as np
import torch

from splitserve.layers.sampling_metadata import PenaltyRow, SamplingMetadata
from splitserve.worker.input_batch import CachedRequestState, InputBatch


def build_sampling_metadata(batch: InputBatch, rows: np.ndarray, states: list[CachedRequestState],
                            num_outputs_before: np.ndarray, device: torch.device) -> SamplingMetadata:
    """rows: the batch rows that sample, in logits order; states: their request states;
    num_outputs_before: output tokens each already has (pending ones included), for min_tokens."""
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
    for i in np.flatnonzero(num_outputs_before < batch.min_tokens[rows]).tolist():
        if states[i].min_tokens_bans:
            meta.min_tokens_bans.append((i, states[i].min_tokens_bans))
    return meta
