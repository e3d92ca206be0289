"""prompt_logprobs on the worker: which hidden rows of a step give prompt tokens' logprobs, their
computation on the device, and their plain-data form for the engine core.

The hidden state at position p predicts token p + 1, so a chunk of positions [start, start + n) of a
request still in its prompt (nothing sampled yet) gives the logprobs of prompt tokens start + 1 up to
the last prompt token (the last prompt position predicts the first output token, which the sampler
handles). Chunked prefill therefore yields one piece per chunk, each tagged with where it starts;
the core puts them together (`Request.add_prompt_logprobs`). A step is planned only when some row of
the persistent batch asks for prompt logprobs (a counter): other steps do nothing more.

Logits are computed in slices of rows so that a long chunk never holds [chunk, vocab] fp32 logits at
once.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from splitserve.layers.sampler import _to_device, token_logprobs

# Most bytes of fp32 logits one slice of prompt rows may take.
SLICE_BYTES = 256 << 20


@dataclass
class PromptLogprobsPlan:
    hidden_rows: np.ndarray  # [m] flat rows of the step's hidden states
    target_ids: np.ndarray   # [m] the prompt token each of them predicts
    max_k: int               # the most top logprobs any of the requests asks for
    # (request id, k, first prompt-token index covered, first plan row, rows) per request
    segments: list[tuple[str, int, int, int, int]]


def plan_prompt_logprobs(ib, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                         query_start: np.ndarray) -> PromptLogprobsPlan | None:
    """The step's prompt-logprob rows: for each scheduled row (`rows`, computing `counts` tokens from
    `starts`, at flat offsets `query_start`) that asks for them and has sampled nothing yet. Called
    before the step's launch is recorded in the batch."""
    k = ib.num_prompt_logprobs[rows]
    hi = np.minimum(starts + counts, ib.num_prompt[rows] - 1)
    sel = np.flatnonzero((k >= 0) & (hi > starts) & (ib.num_tokens[rows] == ib.num_prompt[rows]))
    if not len(sel):
        return None
    lo, n = starts[sel], hi[sel] - starts[sel]
    total = int(n.sum())
    first = np.cumsum(n) - n
    seg = np.repeat(np.arange(len(sel)), n)
    offset = np.arange(total) - first[seg]
    positions = lo[seg] + offset
    hidden_rows = query_start[sel].astype(np.int64)[seg] + offset
    target_ids = ib.token_ids[rows[sel][seg], positions + 1].astype(np.int64)
    segments = [(ib.row_states[r].req_id, int(kk), int(s), int(f), int(c))
                for r, kk, s, f, c in zip(rows[sel].tolist(), k[sel].tolist(), lo.tolist(), first.tolist(),
                                          n.tolist())]
    return PromptLogprobsPlan(hidden_rows, target_ids, int(k[sel].max()), segments)


def compute_prompt_logprobs(model, hidden: torch.Tensor, plan: PromptLogprobsPlan,
                            vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """([m, 1 + k] logprobs, [m, 1 + k] token ids, [m] ranks): each row's prompt token first, then the
    top k, on the device."""
    device = hidden.device
    # Pinned, non-blocking copies: a pageable one would make the host wait for the forward pass.
    rows = _to_device(plan.hidden_rows, device)
    targets = _to_device(plan.target_ids, device)
    step = max(1, SLICE_BYTES // (4 * vocab_size))
    parts = []
    for s in range(0, len(rows), step):
        logits = model.compute_logits(hidden[rows[s:s + step]]).float()
        parts.append(token_logprobs(torch.log_softmax(logits, dim=-1), targets[s:s + step], plan.max_k))
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat(xs) for xs in zip(*parts))


def prompt_logprobs_by_request(plan: PromptLogprobsPlan, values: torch.Tensor, ids: torch.Tensor,
                               ranks: torch.Tensor) -> dict[str, tuple[int, list[dict[int, float]], list[int]]]:
    """Host tensors -> {request id: (first prompt-token index, entries, ranks)}, plain data: each entry
    is {prompt token: logprob, then the request's top k}."""
    vals, tok_ids, all_ranks = values.tolist(), ids.tolist(), ranks.tolist()
    out = {}
    for req_id, k, start, first, count in plan.segments:
        entries = []
        for v, t in zip(vals[first:first + count], tok_ids[first:first + count]):
            entry = {t[0]: v[0]}
            for tt, vv in zip(t[1:1 + k], v[1:1 + k]):
                entry.setdefault(tt, vv)
            entries.append(entry)
        out[req_id] = (start, entries, all_ranks[first:first + count])
    return out
