"""How many drafts each decoding sequence verifies in a step: speculative decoding's back-off.

**Acceptance model.** Each draft of a sequence is accepted with probability a, independently, until
the first rejection: d drafts give 1 + a + ... + a^d tokens in expectation, the j-th draft adds a^j.
a is estimated per request and globally from what verification found: a verify of d drafts that
accepted m is m successes in m + [m < d] trials (the positions actually tested; accepted/proposed
would be biased low by the positions after a rejection, never tested). Both counts decay by a factor
per observation, an exponential moving average (REQUEST_DECAY, GLOBAL_DECAY); a request's estimate
leans on the global one with PRIOR_TRIALS pseudo-trials until it has evidence of its own. The global
estimate starts at INITIAL_ACCEPT (optimistic: speculation is tried, then backs off).

**Cost model**, in units of the fixed cost of one step (weights read, launches):

    step_cost(T) = 1 + T / knee          T: tokens the step runs (decodes, prefill chunks, drafts)
                 + overhead              once, if any sequence verifies drafts

- knee (`adaptive_knee_tokens`, default 64): the tokens that cost as much as the step's fixed part.
  Measured for Llama-3-8B on one H200 from plain decode (batch 1: 4.77 ms, batch 16: 5.30 ms) it is
  ~130, but beyond a few hundred tokens the step is compute-bound and a linear model with that knee
  underprices drafts; 64 is the conservative middle (it turns drafts off at batch 256 even at
  acceptance length 3, and keeps one draft per sequence at batch 64).
- overhead (`adaptive_verify_overhead`, default 0.1): what a verify step pays beyond its tokens:
  it is collected before the next launch (no async overlap), runs without the decode CUDA graphs
  and runs the rejection sampler.

**Plan.** Expected throughput is tokens / step_cost. Every candidate draft (sequence i, position j)
brings a_i^j tokens for 1/knee of cost; taken in order of decreasing gain, the best prefix is kept
if its throughput beats the plain step's, else no sequence verifies. So the per-sequence count
falls with the sequence's acceptance and with the batch (each token costs more relative to what a
step already emits), down to 0. At acceptance length 1.2 (a ~ 0.17 at k = 4) and batch 1 the plan
keeps 1-2 drafts with an expected gain of ~4% under the model, so the measured speed stays at or
above speculation off unless the model's overhead is low by more than that.

**Proposals** (`wants_proposals`): the worker proposes after a step (and that step is collected
before the next launch) only if drafts would pay in the next step, over the sequences that sample
in this one (a prompt's last chunk included: speculation starts right after the prompt).

**Probing.** A sequence given no drafts gives no new evidence. After PROBE_EVERY steps without
drafts, if drafts would pay at PROBE_ACCEPT for this batch, proposals are asked for and in the
next step up to PROBE_SEQS sequences verify up to PROBE_DRAFTS drafts each. At batch 1 with nothing ever
accepted this costs about (2 / knee + overhead) / PROBE_EVERY of the decode time (~0.4%).

Not adaptive (`adaptive: false`): every candidate verifies up to k drafts (the scheduler's caps
still apply). `disable_by_batch_size` is the scheduler's hard cut before any of this.
"""
from __future__ import annotations

import numpy as np

REQUEST_DECAY = 0.8    # a request's counts after each verify: ~5 verifies of memory
GLOBAL_DECAY = 0.98    # the global counts after each verified sequence
PRIOR_TRIALS = 2.0     # weight of the global estimate in a request's
INITIAL_ACCEPT = 0.5   # the global estimate before any verify (with PRIOR_TRIALS trials)
PROBE_EVERY = 32
PROBE_ACCEPT = 0.8
PROBE_SEQS = 4
PROBE_DRAFTS = 2


class SpecController:
    def __init__(self, spec):
        self.k = spec.num_speculative_tokens
        self.adaptive = spec.adaptive
        self.knee = float(spec.adaptive_knee_tokens)
        self.overhead = float(spec.adaptive_verify_overhead)
        self.global_s, self.global_t = INITIAL_ACCEPT * PRIOR_TRIALS, PRIOR_TRIALS
        self._req: dict[str, list[float]] = {}  # request id -> [successes, trials] (decayed)
        self._idle = 0         # steps in a row planned without drafts
        self._probing = False  # the proposals of a probe are on their way: the next plan verifies them

    # -- estimates -----------------------------------------------------------------------------
    def acceptance(self, rid: str) -> float:
        g = self.global_s / self.global_t
        s, t = self._req.get(rid, (0.0, 0.0))
        return (s + PRIOR_TRIALS * g) / (t + PRIOR_TRIALS)

    def observe(self, rid: str, num_drafts: int, num_accepted: int) -> None:
        """A verify's outcome: num_accepted of num_drafts drafts accepted."""
        if num_drafts <= 0:
            return
        trials = num_accepted + (1 if num_accepted < num_drafts else 0)
        st = self._req.setdefault(rid, [0.0, 0.0])
        st[0] = REQUEST_DECAY * st[0] + num_accepted
        st[1] = REQUEST_DECAY * st[1] + trials
        self.global_s = GLOBAL_DECAY * self.global_s + num_accepted
        self.global_t = GLOBAL_DECAY * self.global_t + trials

    def forget(self, rid: str) -> None:
        self._req.pop(rid, None)

    # -- the plan --------------------------------------------------------------------------------
    def step_cost(self, tokens: float, verifies: bool) -> float:
        return 1.0 + tokens / self.knee + (self.overhead if verifies else 0.0)

    def _best(self, accept: np.ndarray, base_tokens: int, num_emitting: int) -> np.ndarray:
        """Drafts per sequence (of acceptances `accept`) that maximise expected tokens per cost; all 0
        when the plain step is at least as good."""
        B = len(accept)
        if not B or self.k == 0:
            return np.zeros(B, dtype=np.int64)
        gains = accept[:, None] ** np.arange(1, self.k + 1)[None, :]   # [B, k]: decreasing along j
        order = np.argsort(-gains, axis=None, kind="stable")
        tokens = num_emitting + np.cumsum(gains.reshape(-1)[order])
        cost = 1.0 + (base_tokens + np.arange(1, len(order) + 1)) / self.knee + self.overhead
        rate = tokens / cost
        best = int(np.argmax(rate))
        if rate[best] <= num_emitting / self.step_cost(base_tokens, False):
            return np.zeros(B, dtype=np.int64)
        return np.bincount(order[:best + 1] // self.k, minlength=B)

    def plan(self, candidates: list[str], base_tokens: int, num_emitting: int) -> dict[str, int]:
        """candidates: ids of the decoding sequences that may speculate this step; base_tokens: the
        step's tokens without drafts; num_emitting: the sequences that sample in it. Returns the drafts
        each candidate may verify now (a cap; it verifies those it has)."""
        if not candidates:
            return {}
        if not self.adaptive:
            return dict.fromkeys(candidates, self.k)
        num_emitting = max(num_emitting, len(candidates))
        counts = self._best(np.array([self.acceptance(r) for r in candidates]), base_tokens, num_emitting)
        if self._probing:
            self._probing = False
            if not counts.any():  # the probe asked for in the step before
                counts[:PROBE_SEQS] = min(self.k, PROBE_DRAFTS)
        self._idle = 0 if counts.any() else self._idle + 1
        return dict(zip(candidates, counts.tolist()))

    def wants_proposals(self, candidates: list[str]) -> bool:
        """Whether the worker proposes drafts after this step, for the next one: `candidates`, the
        sequences that sample in this step and may speculate, are the next step's decodes; proposals
        are asked for when drafts would pay for them there, or when a probe is due."""
        if not candidates:
            return False
        if not self.adaptive:
            return True
        B = len(candidates)
        if self._best(np.array([self.acceptance(r) for r in candidates]), B, B).any():
            return True
        if self._idle >= PROBE_EVERY and self._best(np.full(B, PROBE_ACCEPT), B, B).any():
            self._idle = 0
            self._probing = True
            return True
        return False


def may_speculate(request) -> bool:
    """Whether a decoding request may verify drafts at all: its sampling needs no earlier tokens on
    the host (penalties, bad words) and it is past min_tokens. A grammar's request may: the scheduler
    keeps the drafts its grammar accepts."""
    params = request.sampling_params
    return params.allows_speculation and len(request.output_token_ids) >= params.min_tokens


def propose_next(controller: SpecController, scheduled) -> bool:
    """Whether the worker proposes after this step: over the step's (request, tokens) that sample in
    it (a prompt's last chunk included: speculation starts right after the prompt)."""
    return controller.wants_proposals([r.request_id for r, n in scheduled
                                       if r.num_computed_tokens + n >= r.num_tokens and may_speculate(r)])


def plan_step(controller: SpecController, running, budget: int) -> dict[str, int]:
    """The controller's plan for a step over the running requests (before the waiting ones are
    admitted: new prompts' tokens are not counted)."""
    candidates, base, emitting = [], 0, 0
    for r in running:
        if r.num_computed_tokens >= r.num_prompt_tokens:  # decoding
            emitting += 1
            base += 1
            if may_speculate(r):
                candidates.append(r.request_id)
        else:
            base += r.num_tokens - r.num_computed_tokens
    return controller.plan(candidates, min(base, budget), emitting)
