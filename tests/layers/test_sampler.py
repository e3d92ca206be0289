from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from splitserve.layers.sampler import PenaltyRow, Sampler, SamplingMetadata
from splitserve.sampling_params import SamplingParams

V = 50


@dataclass
class Row:
    """What the worker keeps about a request that the sampler reads (see worker/sampling_metadata.py)."""
    rid: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: tuple[int, ...] = (0,)
    generator: torch.Generator | None = None  # made on the first seeded sample, kept across steps


def req(rid, prompt=(1, 2, 3), output=(), **params):
    return Row(rid, list(prompt), SamplingParams(**params), list(output))


def meta(rows: list[Row]) -> SamplingMetadata:
    """The sampler's per-row data for a batch of rows, in row order."""
    params = [r.sampling_params for r in rows]
    greedy = np.array([p.greedy for p in params], dtype=bool)
    logprobs = [p.logprobs for p in params if p.logprobs is not None]
    m = SamplingMetadata(len(rows), bool(greedy.all()), max_num_logprobs=max(logprobs) if logprobs else None)
    if not m.all_greedy:
        m.greedy = greedy
        m.temperature = np.array([p.temperature for p in params], dtype=np.float64)
        m.top_k = np.array([p.top_k for p in params], dtype=np.int64)
        m.top_p = np.array([p.top_p for p in params], dtype=np.float64)
        m.min_p = np.array([p.min_p for p in params], dtype=np.float64)
        for i, r in enumerate(rows):
            p = r.sampling_params
            if p.seed is not None and not p.greedy:
                if r.generator is None:
                    r.generator = torch.Generator().manual_seed(p.seed)
                m.generators[i] = r.generator
    for i, r in enumerate(rows):
        p = r.sampling_params
        if p.needs_penalties:
            m.penalties.append(PenaltyRow(i, p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
                                          r.prompt_token_ids, r.output_token_ids))
        bans = list(p.stop_token_ids) + ([] if p.ignore_eos else list(r.eos_token_ids))
        if len(r.output_token_ids) < p.min_tokens and bans:
            m.min_tokens_bans.append((i, bans))
    return m


@pytest.fixture(autouse=True)
def _seeded_global_rng():
    """A request without a seed draws from torch's global RNG: seeded for each test, and restored after
    it, so what a test samples does not depend on which tests ran before it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        yield


def test_greedy_is_argmax():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits, meta([req(str(i), temperature=0) for i in range(4)]))
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


def test_seeded_request_is_independent_of_the_batch():
    g = torch.Generator().manual_seed(0)
    row = torch.randn(V, generator=g)
    alone = req("s", seed=123, temperature=1.0)
    seq_alone = [Sampler()(row[None].clone(), meta([alone])).token_ids.item() for _ in range(20)]
    mixed = req("s", seed=123, temperature=1.0)
    others = [req("u", temperature=0.8), req("g", temperature=0), req("t", seed=9, top_k=5)]
    seq_mixed = []
    for _ in range(20):
        batch = [others[0], mixed, others[1], others[2]]
        logits = torch.randn(4, V, generator=g)
        logits[1] = row
        seq_mixed.append(Sampler()(logits, meta(batch)).token_ids[1].item())
    assert seq_alone == seq_mixed
    assert len(set(seq_alone)) > 1  # it does sample, not argmax


def test_truncations_reduce_to_argmax_when_extreme():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    batch = [req("k", top_k=1), req("p", top_p=1e-6), req("m", min_p=1.0)]
    assert Sampler()(logits, meta(batch)).token_ids.tolist() == logits.argmax(-1).tolist()


def test_top_k_keeps_only_k_tokens():
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(0))
    allowed = set(logits[0].topk(3).indices.tolist())
    r = req("k", top_k=3, temperature=5.0)
    got = {Sampler()(logits, meta([r])).token_ids.item() for _ in range(200)}
    assert got <= allowed and len(got) == 3


def test_sampling_follows_the_distribution():
    torch.manual_seed(1)
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log()[None].repeat(4000, 1)
    tokens = Sampler()(logits, meta([req(str(i), temperature=1.0) for i in range(4000)])).token_ids
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(0))
    r = req("r", prompt=(4, 5, 6), output=(7, 5), repetition_penalty=1.3, temperature=0)
    ours = Sampler._apply_penalties(logits, meta([r]).penalties)
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([[4, 5, 6, 7, 5]]), logits.clone())
    assert torch.allclose(ours, ref)


def test_presence_and_frequency_penalties():
    logits = torch.zeros(1, V)
    r = req("r", prompt=(9,), output=(3, 3, 4), presence_penalty=0.5, frequency_penalty=0.25, temperature=0)
    ours = Sampler._apply_penalties(logits, meta([r]).penalties)[0]
    expected = torch.zeros(V)
    expected[3] = -(0.5 + 2 * 0.25)
    expected[4] = -(0.5 + 1 * 0.25)
    assert torch.allclose(ours, expected)  # prompt token 9 untouched


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = torch.full((1, V), -10.0)
    logits[0, 0] = 10.0   # eos
    logits[0, 5] = 9.0    # stop id
    logits[0, 6] = 1.0
    r = req("r", min_tokens=2, stop_token_ids=[5], temperature=0)
    assert Sampler()(logits.clone(), meta([r])).token_ids.item() == 6
    r.output_token_ids = [6, 6]
    assert Sampler()(logits.clone(), meta([r])).token_ids.item() == 0


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(0))
    batch = [req("a", logprobs=3, temperature=0), req("b", temperature=0)]
    out = Sampler()(logits, meta(batch))
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs.shape == (2, 4)
    assert torch.allclose(out.logprobs[0, 0], ref[0].max())
    assert torch.allclose(out.logprobs[0, 1:], ref[0].topk(3).values)
    assert out.logprob_ids[0, 1:].tolist() == ref[0].topk(3).indices.tolist()


def test_bf16_logits_sample_as_their_fp32_values():
    """The model hands over logits in its own dtype: a greedy batch takes their argmax directly, the
    rest is computed in fp32 from the exact conversion, so results equal those of fp32 logits."""
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(1)).bfloat16()
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # a tie: the first index wins either way
    exact = logits.float()
    greedy = [req(str(i), temperature=0) for i in range(6)]
    assert Sampler()(logits.clone(), meta(greedy)).token_ids.tolist() == exact.argmax(-1).tolist()
    assert Sampler()(logits.clone(), meta(greedy)).token_ids[0].item() == 7

    def batch():  # fresh requests per call: a seeded request keeps its generator's state
        return [req("a", logprobs=2, temperature=0), req("p", temperature=0, repetition_penalty=1.5),
                req("s", seed=5, temperature=0.7, top_p=0.9)] + [req(str(i), temperature=0) for i in range(3)]
    out16, out32 = Sampler()(logits.clone(), meta(batch())), Sampler()(exact.clone(), meta(batch()))
    assert out16.token_ids.tolist() == out32.token_ids.tolist()
    assert out16.logprobs.dtype == torch.float32
    assert torch.equal(out16.logprobs, out32.logprobs)
