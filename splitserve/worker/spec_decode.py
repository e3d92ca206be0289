"""The worker's side of speculative decoding: n-gram drafts and the per-row sampling data of a verify step.

Flow (the scheduler's side is in core/scheduler.py): after a step's tokens are known, the worker
proposes up to k drafts for each sequence that sampled (`StepResult.draft_token_ids`); the scheduler
keeps them on the request and, in the next step, schedules the sequence's last token plus the drafts
it accepts to run (budget, max_tokens, the context) and sends them in `SchedulerOutput.spec_token_ids`.
The runner writes the drafts after the row's known tokens, runs them as a short prefill over the
paged KV, takes d + 1 logits rows for the sequence and verifies them (layers/rejection_sampler.py).
At collect the row gains the accepted drafts and one more token, and its computed count goes back
by the rejected drafts: their K/V slots hold garbage that the next step overwrites (the blocks stay
with the request; the scheduler rolls its count back the same way and never registers a block with
rejected slots in the prefix cache).
"""
from __future__ import annotations

import numpy as np

from splitserve.layers.sampling_metadata import PenaltyRow, SamplingMetadata


class NgramProposer:
    """Prompt lookup: the longest suffix of the sequence (prompt_lookup_max tokens down to
    prompt_lookup_min) that occurred earlier proposes the k tokens that followed its latest earlier
    occurrence."""

    def __init__(self, k: int, min_n: int, max_n: int):
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, tokens: np.ndarray) -> list[int]:
        L = len(tokens)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            suffix = tokens[L - n:]
            # Starts i < L - n of earlier windows tokens[i:i + n] equal to the suffix (vectorised per offset).
            match = tokens[:L - n] == suffix[0]
            for j in range(1, n):
                match &= tokens[j:L - n + j] == suffix[j]
            hits = np.flatnonzero(match)
            if len(hits):
                start = int(hits[-1]) + n
                return tokens[start:start + self.k].tolist()
        return []

    def propose_many(self, token_ids: np.ndarray, rows: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
        """`propose` for many rows of a token matrix at once (row i: token_ids[rows[i], :lengths[i]]):
        one pass finds, in every row, the earlier positions holding the row's last token; each such
        candidate is then extended backwards (up to prompt_lookup_max tokens), and a row takes its
        longest match, latest first. A loaded server's step pays one array pass, not a loop."""
        S = len(rows)
        out: list[list[int]] = [[] for _ in range(S)]
        if not S:
            return out
        L = int(lengths.max())
        T = token_ids[rows, :L]
        last = T[np.arange(S), lengths - 1]
        # p: the end of an earlier window (p < length - 1, so never the suffix itself)
        cand = (T[:, :max(L - 1, 0)] == last[:, None]) & (np.arange(max(L - 1, 0))[None, :] < (lengths - 1)[:, None])
        ri, pi = np.nonzero(cand)
        if not len(ri):
            return out
        n = np.ones(len(ri), dtype=np.int64)  # matched suffix length at each candidate
        alive = np.ones(len(ri), dtype=bool)
        for j in range(1, self.max_n):
            back = lengths[ri] - 1 - j
            ok = alive & (pi - j >= 0) & (back >= 0)
            ok[ok] = T[ri[ok], pi[ok] - j] == T[ri[ok], back[ok]]
            n += ok
            alive = ok
        n = np.minimum(n, lengths[ri] - 1)
        score = np.where(n >= self.min_n, n * (L + 1) + pi, -1)
        best = np.full(S, -1, dtype=np.int64)
        np.maximum.at(best, ri, score)
        for i in np.flatnonzero(best >= 0).tolist():
            start = int(best[i] % (L + 1)) + 1
            out[i] = T[i, start:min(start + self.k, int(lengths[i]))].tolist()
        return out


def write_drafts(ib, spec_token_ids: dict[str, list[int]], req_ids, rows: np.ndarray) -> np.ndarray:
    """Writes each verifying request's drafts after its known tokens in the persistent batch (`ib`,
    an InputBatch; tentatively: collect keeps the accepted ones); returns the drafts per scheduled
    sequence (req_ids, rows: the step's order)."""
    num_drafts = np.zeros(len(rows), dtype=np.int64)
    if spec_token_ids:
        index = {rid: i for i, rid in enumerate(req_ids)}
        for rid, ids in spec_token_ids.items():
            i = index[rid]
            row = rows[i]
            num_drafts[i] = len(ids)
            known = ib.num_known[row]
            assert known == ib.num_tokens[row], "drafts of a request with a token in flight"
            ib.token_ids[row, known:known + len(ids)] = ids
    return num_drafts


def expand_metadata(meta: SamplingMetadata, repeats: np.ndarray) -> SamplingMetadata:
    """Sampling data of a verify step's logits rows: sequence i's parameters over repeats[i]
    consecutive rows (its drafts + 1). Sequences with penalties, several-token bad words or
    min_tokens bans have no drafts (SamplingParams.allows_speculation, the scheduler's checks), so
    their per-row lists only move to the sequence's first row. A constrained sequence's mask rows
    cover all its rows (the core filled d + 1 for it: row j, its grammar after j drafts)."""
    starts = np.zeros(len(repeats), dtype=np.int64)
    np.cumsum(repeats[:-1], out=starts[1:])
    R = int(repeats.sum())

    def rep(a):
        return None if a is None else np.repeat(a, repeats)

    def rows_of(seq_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every (row) for each entry of seq_rows, and the entry index each comes from."""
        r = repeats[seq_rows]
        first = np.repeat(starts[seq_rows], r)
        within = np.arange(int(r.sum())) - np.repeat(np.cumsum(r) - r, r)
        return first + within, np.repeat(np.arange(len(seq_rows)), r)

    out = SamplingMetadata(R, meta.all_greedy, rep(meta.greedy), rep(meta.temperature), rep(meta.top_k),
                           rep(meta.top_p), rep(meta.min_p), max_num_logprobs=meta.max_num_logprobs,
                           grammar_after_launch=meta.grammar_after_launch, reads_history=meta.reads_history)
    for i, g in meta.generators.items():
        for r in range(int(starts[i]), int(starts[i] + repeats[i])):
            out.generators[r] = g
    out.penalties = [PenaltyRow(int(starts[p.row]), p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
                                p.prompt_token_ids, p.output_token_ids) for p in meta.penalties]
    if meta.bias_rows is not None:
        out.bias_rows, src = rows_of(meta.bias_rows)
        out.bias_token_ids, out.bias_values = meta.bias_token_ids[src], meta.bias_values[src]
    if meta.allowed_rows is not None:
        out.allowed_rows, src = rows_of(meta.allowed_rows)
        out.allowed_token_ids = meta.allowed_token_ids[src]
    if meta.grammar_rows is not None:
        out.grammar_rows, _ = rows_of(meta.grammar_rows)
        out.grammar_bitmask = meta.grammar_bitmask
    return out


def verified_logprobs(result, states, new_tokens: list[list[int]], row_start: list[int], vals, tok_ids,
                      ranks) -> None:
    """Fills a StepResult's logprobs of a verify step: per request that asked, the entry of its first
    new token (`logprobs`, `logprob_ranks`) and of the rest (`more_logprobs`, `more_logprob_ranks`),
    from the host lists of the verifier's rows ([R][1 + k] values and ids, [R] ranks)."""
    for state, tokens, start in zip(states, new_tokens, row_start):
        k = state.sampling_params.logprobs
        if k is None:
            continue
        entries = []
        for r in range(start, start + len(tokens)):
            entry = {tok_ids[r][0]: vals[r][0]}
            for t, v in zip(tok_ids[r][1:1 + k], vals[r][1:1 + k]):
                entry.setdefault(t, v)
            entries.append(entry)
        rid, row_ranks = state.req_id, ranks[start:start + len(tokens)]
        result.logprobs[rid], result.logprob_ranks[rid] = entries[0], row_ranks[0]
        if len(tokens) > 1:
            result.more_logprobs[rid], result.more_logprob_ranks[rid] = entries[1:], row_ranks[1:]


def collect_verified(result, ib, step) -> None:
    """A verify step's results into `result` (a StepResult): each row's accepted drafts and the token
    after them recorded in the persistent batch `ib` (its computed count back by the rejected
    drafts), with their logprobs."""
    _, logprob_vals, logprob_ids, logprob_ranks, num_accepted, next_token = step.host
    states, drafts = step.sample_requests, step.drafts
    accepted, nexts = num_accepted.tolist(), next_token.tolist()
    new_tokens = [d[:m] + [t] for d, m, t in zip(drafts, accepted, nexts)]
    ib.record_verified(states, new_tokens, [len(d) - m for d, m in zip(drafts, accepted)])
    result.tokens.update({s.req_id: t[0] for s, t in zip(states, new_tokens)})
    for state, tokens in zip(states, new_tokens):
        if len(tokens) > 1:
            result.more_tokens[state.req_id] = tokens[1:]
    if logprob_vals is not None:
        verified_logprobs(result, states, new_tokens, step.verify.row_start.tolist(),
                          logprob_vals.tolist(), logprob_ids.tolist(), logprob_ranks.tolist())


def propose_drafts(ib, states, drafter, proposer) -> dict[str, list[int]]:
    """Drafts for each sampling request still in the batch that may speculate: the draft model's
    (`drafter`), else the n-gram `proposer`'s over the batch's known tokens."""
    if drafter is not None:
        return drafter.propose(ib, states)
    out: dict[str, list[int]] = {}
    if proposer is None:
        return out
    states = [s for s in states if s.row >= 0 and s.sampling_params.allows_speculation]
    rows = np.array([s.row for s in states], dtype=np.int64)
    for state, drafts in zip(states, proposer.propose_many(ib.token_ids, rows, ib.num_known[rows])):
        if drafts:
            out[state.req_id] = drafts
    return out
