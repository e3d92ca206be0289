"""Speculative decoding end to end on the default model (CPU, fp32): n-gram drafts give exactly the
greedy tokens of speculation off (and accept drafts on prompts that copy text), with logprobs, stop
strings, max_tokens, n > 1, prefix-cache hits, structured output in the same batch, async scheduling
and preemptions; the block pool is whole afterwards. On a tiny random model with a 16-token vocabulary,
temperature 1.0 sampling gives the same distributions of the speculated tokens (the second and third:
the first comes from the prefill) as speculation off.""" 
from __future__ import annotations

import numpy as np
import pytest
import torch

from splitserve.engine.llm import LLM
from splitserve.loading.resolve import load_tokenizer
from splitserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.hf_reference import make_tiny_llama_dir

SMALL = dict(max_model_len=512, cpu_kv_cache_gib=0.1, max_num_seqs=8, dtype="float32")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
PROMPTS = [
    "Copy this sentence exactly: the quick brown fox jumps over the lazy dog. Copy: the quick brown",
    "Fix the typo in this paragraph: 'Speculative decoding let a small draft propose tokens that the large "
    "model verifys in one pass.' Fixed: 'Speculative decoding",
    "Hello, my name is",
    "1, 2, 3, 4, 5, 6, 7, 8,",
]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def spec_counters(llm) -> tuple[int, int]:
    s = llm.engine.core.scheduler
    return s.spec_num_draft_tokens, s.spec_num_accepted_tokens


@pytest.fixture(scope="module")
def base():
    return LLM(None, **SMALL)


@pytest.fixture(scope="module")
def reference(base):
    outs = base.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2),
                         use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def spec():
    return LLM(None, speculative_config=NGRAM, **SMALL)


def test_greedy_tokens_and_logprobs_equal_speculation_off(spec, reference):
    outs = spec.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2),
                         use_tqdm=False)
    for out, ref in zip(outs, reference):
        got = out.outputs[0]
        assert got.token_ids == ref.token_ids
        assert len(got.logprobs) == len(ref.logprobs) == 32
        for a, b in zip(got.logprobs, ref.logprobs):
            assert list(a) == list(b)  # the token, then the same top 2
            assert all(abs(float(a[t]) - float(b[t])) < 1e-3 for t in a)
    drafted, accepted = spec_counters(spec)
    assert accepted > 0 and drafted > accepted
    assert spec.engine.kv_manager.pool.is_whole() or spec.engine.kv_manager.enable_prefix_caching


def test_stop_strings_max_tokens_and_n(spec, reference):
    ref = reference[0]
    text = ref.text
    stop = text[len(text) // 2: len(text) // 2 + 6]  # a stop string inside the copied run
    params = SamplingParams(temperature=0, max_tokens=32, stop=[stop], ignore_eos=True)
    base_cut = text[:text.index(stop)]
    out = spec.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert out.text == base_cut and out.finish_reason == "stop"
    for max_tokens in (1, 2, 5, 7):
        out = spec.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                            use_tqdm=False)
        for o, r in zip(out, reference):
            assert o.outputs[0].token_ids == r.token_ids[:max_tokens]
    outs = spec.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, n=3),
                         use_tqdm=False)[0].outputs
    assert [o.token_ids for o in outs] == [reference[1].token_ids] * 3


def test_prefix_hits_and_structured_output_in_the_same_batch(spec, reference):
    hits_before = spec.engine.kv_manager.prefix_hits
    constrained = SamplingParams(temperature=0, max_tokens=20,
                                 structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"]))
    outs = spec.generate(PROMPTS + ["Answer yes or no: is the sky blue?"], [GREEDY] * len(PROMPTS) + [constrained],
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:-1]] == [r.token_ids for r in reference]
    assert outs[-1].outputs[0].text in ("yes", "no", "maybe")
    assert spec.engine.kv_manager.prefix_hits > hits_before


def test_async_scheduling_and_preemptions(reference):
    """A pool of 12 blocks of 16 tokens for four ~40-token prompts growing to ~72: preemptions happen
    while drafts are verified."""
    llm = LLM(None, speculative_config=NGRAM, async_scheduling=True, num_blocks=12,
              **{k: v for k, v in SMALL.items() if k != "cpu_kv_cache_gib"})
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r.token_ids for r in reference]
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert spec_counters(llm)[1] > 0
    llm.engine.kv_manager.pool.reset_prefix_cache()
    assert llm.engine.kv_manager.pool.is_whole()


# -- sampling: the distribution equals speculation off --------------------------------------------
VOCAB = 16
SAMPLES = 4000


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny-spec"), load_tokenizer(None), num_kv_heads=2,
                               tie=True, seed=3, vocab_size=VOCAB, initializer_range=0.05)


def _tokens_2_3(llm) -> np.ndarray:
    """The second and third tokens of SAMPLES samples: the step after the prefill verifies one draft
    (max_tokens leaves room for one: the accepted run and one more token)."""
    prompt = [1, 5, 6, 7, 5, 6, 7, 5, 6]
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, n=500)
    pairs = []
    for _ in range(SAMPLES // 500):
        for o in llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs:
            pairs.append(o.token_ids[1:])
    return np.array(pairs)


def _two_sample_p(a: np.ndarray, b: np.ndarray) -> float:
    """Chi-square two-sample homogeneity test's p-value over the values' counts (rare cells pooled)."""
    ca, cb = np.bincount(a, minlength=VOCAB), np.bincount(b, minlength=VOCAB)
    keep = (ca + cb) >= 20
    ca = np.append(ca[keep], ca[~keep].sum())
    cb = np.append(cb[keep], cb[~keep].sum())
    if ca[-1] + cb[-1] == 0:
        ca, cb = ca[:-1], cb[:-1]
    table = np.stack([ca, cb]).astype(np.float64)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    return float(torch.special.gammaincc(torch.tensor((table.shape[1] - 1) / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_sampling_distribution_equals_speculation_off(tiny_dir):
    kw = dict(max_model_len=64, cpu_kv_cache_gib=0.05, max_num_seqs=256, tokenizer=None, seed=0)
    off = _tokens_2_3(LLM(tiny_dir, **kw))
    spec_llm = LLM(tiny_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2}, **kw)
    on = _tokens_2_3(spec_llm)
    assert spec_counters(spec_llm)[1] > 50  # drafts were accepted: some third tokens came from one
    assert _two_sample_p(off[:, 0], on[:, 0]) > 1e-3
    assert _two_sample_p(off[:, 1], on[:, 1]) > 1e-3

