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
    bias = []  # (row, token, value)
    for i, r in enumerate(rows):
        p = r.sampling_params
        if p.needs_penalties:
            m.penalties.append(PenaltyRow(i, p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
                                          r.prompt_token_ids, r.output_token_ids))
        bans = list(p.stop_token_ids) + ([] if p.ignore_eos else list(r.eos_token_ids))
        if len(r.output_token_ids) < p.min_tokens:
            bias += [(i, t, float("-inf")) for t in bans]
        bias += [(i, t, v) for t, v in (p.logit_bias or {}).items()]
    if bias:
        m.bias_rows, m.bias_token_ids, m.bias_values = (np.array(col, dtype=dt) for col, dt in
                                                        zip(zip(*bias), (np.int64, np.int64, np.float32)))
    allowed = [(i, t) for i, r in enumerate(rows) for t in r.sampling_params.allowed_token_ids or ()]
    if allowed:
        m.allowed_rows, m.allowed_token_ids = (np.array(col, dtype=np.int64) for col in zip(*allowed))
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


# -- logit changes by request: logit_bias, allowed_token_ids, grammar bitmasks -------------------------
def test_logit_bias_bans_and_forces_in_one_batch():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    top = logits.argmax(-1).tolist()
    batch = [req("ban", temperature=0, logit_bias={top[0]: -100}),
             req("force", temperature=1.0, logit_bias={7: 100}),
             req("plain", temperature=0)]
    for _ in range(20):
        out = Sampler()(logits.clone(), meta(batch)).token_ids.tolist()
        assert out[0] == logits[0].topk(2).indices[1].item()  # the next best once the best is banned
        assert out[1] == 7 and out[2] == top[2]


def test_logit_bias_is_added_to_the_logits():
    """A moderate bias shifts the distribution as adding it to the logits does (plain torch reference)."""
    torch.manual_seed(3)
    logits = torch.zeros(4000, 3)
    r = [req(str(i), temperature=1.0, logit_bias={2: float(np.log(3.0))}) for i in range(4000)]
    tokens = Sampler()(logits, meta(r)).token_ids
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.softmax(torch.tensor([0.0, 0.0, np.log(3.0)]), 0).float(), atol=0.03)


def test_allowed_token_ids_restrict_only_their_rows():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(4))
    allowed = [3, 11, 40]
    batch = [req("a", temperature=2.0, allowed_token_ids=allowed), req("g", temperature=0),
             req("b", temperature=0, allowed_token_ids=[9])]
    seen = set()
    for _ in range(100):
        out = Sampler()(logits.clone(), meta(batch)).token_ids.tolist()
        seen.add(out[0])
        assert out[1] == logits[1].argmax().item() and out[2] == 9
    assert seen == set(allowed)


def random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2 ** 31, 2 ** 31 - 1, (rows, -(-vocab // 32)), dtype=torch.int32, generator=g)


@pytest.mark.parametrize("vocab", [64, 50, 1000])
def test_token_bitmask_matches_xgrammar(vocab):
    """The sampler's bitmask masking equals xgrammar's own kernel on the same rows."""
    import xgrammar as xgr
    from splitserve.layers.sampler import apply_token_bitmask
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(5))
    rows = torch.tensor([0, 2, 5])
    bitmask = random_bitmask(3, vocab, seed=vocab)
    ours = logits.clone()
    apply_token_bitmask(ours, rows, bitmask)
    ref = logits.clone()
    full = torch.full((6, bitmask.shape[1]), -1, dtype=torch.int32)
    full[rows] = bitmask
    xgr.apply_token_bitmask_inplace(ref, full, vocab_size=vocab, indices=rows.tolist())
    assert torch.equal(ours, ref)
    assert torch.equal(ours[[1, 3, 4]], logits[[1, 3, 4]])  # other rows untouched


def test_token_bitmask_bans_ids_past_its_width():
    """Logits wider than the bitmask (a vocabulary padded past the tokenizer's): the extra ids are banned."""
    from splitserve.layers.sampler import apply_token_bitmask
    logits = torch.zeros(1, 70)
    apply_token_bitmask(logits, torch.tensor([0]), torch.full((1, 2), -1, dtype=torch.int32))
    assert torch.isfinite(logits[0, :64]).all() and torch.isneginf(logits[0, 64:]).all()


def test_grammar_rows_sample_only_allowed_tokens():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(6))
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = (1 << 4) | (1 << 9)   # row 0 may sample 4 or 9
    bitmask[1, 1] = 1 << (33 - 32)        # row 2 may sample 33 only
    batch = [req("c", temperature=3.0), req("u", temperature=0), req("d", temperature=0)]
    m = meta(batch)
    m.grammar_rows, m.grammar_bitmask = np.array([0, 2]), bitmask
    assert m.needs_host_tokens
    seen = set()
    for _ in range(100):
        out = Sampler()(logits.clone(), m)
        seen.add(out.token_ids[0].item())
        assert out.token_ids[1:].tolist() == [logits[1].argmax().item(), 33] and out.needs_host_tokens
    assert seen == {4, 9}
