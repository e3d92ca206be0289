"""The speculative verifier (layers/rejection_sampler.py): greedy matching, and the exactness of
rejection sampling: output tokens distributed as plain sampling from the target (chi-square tests over
many rows in one call), for one-hot (n-gram) and proper draft distributions."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from splitserve.layers.rejection_sampler import RejectionSampler, VerifyLayout
from splitserve.layers.sampling_metadata import SamplingMetadata
from splitserve.worker.spec_decode import expand_metadata


def _meta(num_seqs: int, greedy: bool, temperature: float = 1.0, **kw) -> SamplingMetadata:
    meta = SamplingMetadata(num_seqs, greedy)
    if not greedy:
        meta.greedy = np.zeros(num_seqs, dtype=bool)
        meta.temperature = np.full(num_seqs, temperature)
        meta.top_k = np.zeros(num_seqs, dtype=np.int64)
        meta.top_p = np.ones(num_seqs)
        meta.min_p = np.zeros(num_seqs)
    for k, v in kw.items():
        setattr(meta, k, v)
    return meta


def test_greedy_accepts_the_matching_prefix_plus_one():
    V = 10
    # Sequence 0: drafts [3, 4, 5], target argmaxes 3, 4, 7, 1 -> accepts 2, then 7.
    # Sequence 1: no drafts, argmax 6. Sequence 2: drafts [2], argmaxes 2, 8 -> accepts 1, bonus 8.
    # Sequence 3: drafts [9, 9], argmax 0 first -> accepts none, correction 0.
    argmaxes = [3, 4, 7, 1, 6, 2, 8, 0, 9, 9]
    logits = torch.full((len(argmaxes), V), -1.0)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    layout = VerifyLayout.build([[3, 4, 5], [], [2], [9, 9]])
    meta = expand_metadata(_meta(4, True, max_num_logprobs=1), layout.num_drafts + 1)
    out = RejectionSampler()(logits, meta, layout)
    assert out.num_accepted.tolist() == [2, 0, 1, 0]
    assert out.next_token.tolist() == [7, 6, 8, 0]
    assert out.first_token.tolist() == [3, 6, 2, 0]
    # logprobs: each row's emitted token (draft where accepted, the correction at the first reject)
    assert out.logprob_ids[:, 0].tolist()[:3] == [3, 4, 7]
    assert out.logprob_ids[4, 0].item() == 6 and out.logprob_ids[7, 0].item() == 0
    assert out.logprob_ranks[:3].tolist() == [1, 1, 1]


def _chi2_ok(samples: np.ndarray, probs: np.ndarray) -> float:
    """The chi-square test's p-value of samples against probs (rare cells pooled)."""
    counts = np.bincount(samples, minlength=len(probs))
    expected = probs * len(samples)
    keep = expected > 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * obs.sum() / exp.sum()
    stat = float(((obs - exp) ** 2 / exp).sum())
    # P(chi2 with len - 1 degrees of freedom >= stat): the regularised upper incomplete gamma
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("draft_kind", ["one_hot", "distribution"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_is_exact(draft_kind, temperature):
    """20k sequences, each with 2 drafts over a 6-token vocabulary: the first new token follows p_0,
    the second (given the first draft was accepted) follows p_1 (the target's, after temperature)."""
    torch.manual_seed(0)
    V, N, d = 6, 20000, 2
    base = torch.randn(d + 1, V) * 1.5
    gen = torch.Generator().manual_seed(1)
    if draft_kind == "one_hot":
        drafts = np.tile([2, 4], (N, 1))
        q = None
    else:  # the draft samples its tokens from its own distribution q (per position)
        q_rows = torch.softmax(torch.randn(d, V), -1)
        drafts = np.stack([torch.multinomial(q_rows[j], N, replacement=True, generator=gen).numpy()
                           for j in range(d)], 1)
        q = torch.zeros(N * (d + 1), V)
        for j in range(d):
            q[j::d + 1] = q_rows[j]
    layout = VerifyLayout.build(drafts.tolist())
    logits = base.repeat(N, 1)
    meta = expand_metadata(_meta(N, False, temperature), layout.num_drafts + 1)
    out = RejectionSampler()(logits, meta, layout, q)
    p = torch.softmax(base / temperature, -1).numpy().astype(np.float64)
    m, nxt = out.num_accepted.numpy(), out.next_token.numpy()
    first = np.where(m > 0, drafts[:, 0], nxt)
    assert _chi2_ok(first, p[0]) > 1e-3
    # Second token among the sequences whose first token was drafts[:, 0] accepted. For one-hot
    # drafts the context of row 1 is the same for all of them (the first draft is fixed).
    if draft_kind == "one_hot":
        acc = m >= 1
        second = np.where(m[acc] > 1, drafts[acc, 1], nxt[acc])
        assert acc.sum() > 2000
        assert _chi2_ok(second, p[1]) > 1e-3
    assert (m <= d).all() and m.max() == d


def test_seeded_rows_repeat_and_ignore_the_batch():
    V = 8
    torch.manual_seed(3)
    base = torch.randn(3, V)

    def run(other_rows: int):
        drafts = [[1, 2]] + [[3]] * other_rows
        layout = VerifyLayout.build(drafts)
        logits = torch.cat([base, torch.randn(2 * other_rows, V)])
        meta = _meta(1 + other_rows, False)
        meta.generators = {0: torch.Generator().manual_seed(42)}
        out = RejectionSampler()(logits, expand_metadata(meta, layout.num_drafts + 1), layout)
        return out.num_accepted[0].item(), out.next_token[0].item()

    assert len({run(k) for k in (0, 1, 5)}) == 1


def test_forced_acceptance_hook():
    """The benchmarks' measurement hook: a rate in [0, 1] or a start-up ValueError; on, drafts are
    accepted by a seeded draw (a = 1: all, a = 0: none), the token after them still the argmax."""
    from splitserve.layers.rejection_sampler import forced_acceptance
    assert forced_acceptance("") is None and forced_acceptance("0.5") == 0.5
    for bad in ("1.5", "-0.1", "often"):
        with pytest.raises(ValueError, match="SPLITSERVE_SPEC_FORCE_ACCEPT"):
            forced_acceptance(bad)
    argmaxes = [3, 4, 7, 1, 6, 8]
    logits = torch.full((len(argmaxes), 10), -1.0)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    layout = VerifyLayout.build([[9, 9, 9], [2]])
    meta = expand_metadata(_meta(2, True), layout.num_drafts + 1)
    out = RejectionSampler(force_accept=1.0)(logits, meta, layout)
    assert out.num_accepted.tolist() == [3, 1] and out.next_token.tolist() == [1, 8]
    out = RejectionSampler(force_accept=0.0)(logits, meta, layout)
    assert out.num_accepted.tolist() == [0, 0] and out.next_token.tolist() == [3, 6]
