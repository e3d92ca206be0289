"""Verification of speculative drafts on the device: greedy matching and exact rejection sampling.

A verifying sequence brings d draft tokens x_1..x_d and gets d + 1 logits rows: row j is the target's
distribution p_j of the token after its last token and x_1..x_j. Rows are in logits order, each
sequence's rows together; a sequence without drafts has one row (it samples as usual).

- Greedy rows accept x_{j+1} while it is the argmax of row j; the first mismatch is replaced by the
  argmax, and when every draft matches the last row's argmax is the bonus token. The tokens are the
  ones plain greedy decoding would give.
- Sampled rows accept x_{j+1} with probability min(1, p_j(x) / q_j(x)), q_j the draft's distribution;
  at the first rejection the token is drawn from max(0, p_j - q_j) renormalised; when all are
  accepted the bonus is drawn from the last row's p. N-gram drafts are deterministic (q one-hot at
  x): accept with probability p_j(x), else draw from p_j with x removed. Either way each output token
  is distributed exactly as plain sampling from p (the standard speculative-sampling argument), and
  every draw of a seeded request comes from its own generator.

p is the distribution the plain sampler draws from: the same processing of the logits (biases,
allowed tokens, temperature, top-k/p, min-p) by layers/sampler.py, renormalised after the cuts.

Output, per sequence: how many drafts were accepted (m) and the token after them (the correction or
the bonus); its new tokens are x_1..x_m and that token. Per row, the token the row emitted (the draft
where accepted, the correction at row m), for logprobs.

Measurement hook (benchmarks only, off by default): with SPLITSERVE_SPEC_FORCE_ACCEPT=a set when the
runner starts, each draft is accepted with probability a (a seeded draw, independent of the logits)
instead of by the rules above; the token after the accepted run stays the target's (argmax for greedy
rows). The verify compute, rollback and scheduling are those of real speculation, but the acceptance
length is a known one whatever the numerics (random weights: near-tied logits that a verify step and a
plain step round differently). Outputs then differ from speculation off.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from splitserve.layers.sampler import Sampler, _to_device, token_logprobs
from splitserve.layers.sampling_metadata import SamplingMetadata

logger = logging.getLogger(__name__)

FORCE_ACCEPT_ENV = "SPLITSERVE_SPEC_FORCE_ACCEPT"


def forced_acceptance(value: str | None = None) -> float | None:
    """The forced acceptance rate of the measurement hook (default: from the environment), or None
    (the normal case); a value that is not a number in [0, 1] is a ValueError at start-up."""
    value = os.environ.get(FORCE_ACCEPT_ENV) if value is None else value
    if not value:
        return None
    try:
        a = float(value)
    except ValueError:
        a = -1.0
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"{FORCE_ACCEPT_ENV}: expected an acceptance rate in [0, 1], got {value!r}")
    logger.warning("speculative acceptance is forced (%s=%s): a measurement hook, outputs are not the "
                   "model's", FORCE_ACCEPT_ENV, value)
    return a


@dataclass
class VerifyLayout:
    """Where each sequence's rows are among the logits rows, and its drafts (host data)."""
    num_drafts: np.ndarray     # [S] drafts of each sequence (0: a plain sampling row)
    row_start: np.ndarray      # [S] first logits row of each sequence
    draft_ids: np.ndarray      # [R] the draft each row checks (-1: the last row of a sequence)

    @property
    def num_rows(self) -> int:
        return len(self.draft_ids)

    @classmethod
    def build(cls, drafts: list[list[int]]) -> "VerifyLayout":
        num = np.fromiter((len(d) for d in drafts), dtype=np.int64, count=len(drafts))
        start = np.zeros(len(drafts), dtype=np.int64)
        np.cumsum(num[:-1] + 1, out=start[1:])
        ids = np.full(int(num.sum()) + len(drafts), -1, dtype=np.int64)
        for s, d in zip(start.tolist(), drafts):
            ids[s:s + len(d)] = d
        return cls(num, start, ids)


@dataclass
class VerifyOutput:
    num_accepted: torch.Tensor   # [S] accepted drafts of each sequence
    next_token: torch.Tensor     # [S] the token after the accepted drafts (correction or bonus)
    first_token: torch.Tensor    # [S] each sequence's first new token (the pending input of async steps)
    logprobs: torch.Tensor | None = None      # [R, 1 + k] of the token each row emitted, then the top k
    logprob_ids: torch.Tensor | None = None   # [R, 1 + k]
    logprob_ranks: torch.Tensor | None = None  # [R]


def _uniforms(num_rows: int, meta: SamplingMetadata, device: torch.device) -> torch.Tensor:
    """One U(0, 1) per row; a seeded row's from its generator (rows in ascending order, as the
    sampler's race draws, so a seeded request's draws do not depend on the rest of the batch)."""
    u = torch.rand(num_rows, device=device)
    for i in sorted(meta.generators):
        u[i] = torch.rand((), generator=meta.generators[i], device=device)
    return u


class RejectionSampler:
    def __init__(self, sampler: Sampler | None = None, force_accept: float | None = None):
        self.sampler = sampler or Sampler()
        # The measurement hook (module docstring): None unless asked; benchmarks may set it between runs.
        self.force_accept = force_accept
        self._force_generator: torch.Generator | None = None

    def _forced(self, num_rows: int, device: torch.device) -> torch.Tensor:
        """[R] each row accepted with probability force_accept, from one generator seeded at first use."""
        if self._force_generator is None:
            self._force_generator = torch.Generator(device=device)
            self._force_generator.manual_seed(0)
        return torch.rand(num_rows, generator=self._force_generator, device=device) < self.force_accept

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata, layout: VerifyLayout,
                 draft_probs: torch.Tensor | None = None) -> VerifyOutput:
        """logits: [R, V] in layout's row order; meta: per row (each sequence's parameters repeated
        over its rows, worker/spec_decode.py expand_metadata); draft_probs: [R, V] q of each row
        with a draft (None: the drafts are deterministic, q one-hot)."""
        device = logits.device
        R = logits.shape[0]
        logits, raw_logprobs = self.sampler.process(logits, meta)
        draft = _to_device(layout.draft_ids, device)
        has_draft = draft >= 0
        safe_draft = draft.clamp(min=0)
        target = logits.argmax(dim=-1)
        if meta.all_greedy:
            accept = (target == draft) & has_draft
            correction = target
        else:
            probs = self.sampler.probs(logits, meta)
            probs = probs / probs.sum(dim=-1, keepdim=True)
            p_x = probs.gather(1, safe_draft[:, None]).squeeze(1)
            if draft_probs is None:
                q_x = torch.ones_like(p_x)
                residual = probs.scatter(1, safe_draft[:, None], 0.0)
            else:
                q_x = draft_probs.gather(1, safe_draft[:, None]).squeeze(1)
                residual = (probs - draft_probs).clamp_(min=0.0)
            # A row without a draft (a sequence's last) draws from p itself: the bonus token.
            residual = torch.where(has_draft[:, None], residual, probs)
            u = _uniforms(R, meta, device)
            accept = (u * q_x < p_x) & has_draft
            correction = self.sampler.race(residual, meta)
            greedy = _to_device(meta.greedy, device)
            accept = torch.where(greedy, (target == draft) & has_draft, accept)
            correction = torch.where(greedy, target, correction)
        if self.force_accept is not None:
            accept = self._forced(R, device) & has_draft

        # Per sequence: the accepted prefix of its drafts ([S, k] gathered, padded with a row that rejects).
        S = len(layout.num_drafts)
        k = int(layout.num_drafts.max()) if S else 0
        offsets = np.arange(max(k, 1))
        valid = offsets[None, :] < layout.num_drafts[:, None]
        index = np.where(valid, layout.row_start[:, None] + offsets[None, :], R)
        accept_pad = torch.cat([accept, accept.new_zeros(1)])[_to_device(index, device)]
        num_accepted = accept_pad.long().cumprod(dim=1).sum(dim=1)
        row_start = _to_device(layout.row_start, device)
        next_token = correction[row_start + num_accepted]
        first_token = torch.where(num_accepted > 0, draft[row_start], next_token)
        out = VerifyOutput(num_accepted, next_token, first_token)
        if raw_logprobs is not None:
            # Row j of a sequence emitted its draft if j < m, the correction if j == m (later rows: unused).
            seq_of_row = _to_device(np.repeat(np.arange(S), layout.num_drafts + 1), device)
            j = torch.arange(R, device=device) - row_start[seq_of_row]
            emitted = torch.where(j < num_accepted[seq_of_row], safe_draft, correction)
            out.logprobs, out.logprob_ids, out.logprob_ranks = token_logprobs(raw_logprobs, emitted,
                                                                              meta.max_num_logprobs)
        return out
