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
    assert spec.engine.kv_manager.pool.is_whole()


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
    outs = spec.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, n=4),
                         use_tqdm=False)[0].outputs
    assert [o.token_ids for o in outs] == [reference[1].token_ids] * 4


def test_prefix_hits_and_structured_output_in_the_same_batch(spec, reference):
    hits_before = spec.engine.kv_manager.prefix_hits
    constrained = SamplingParams(temperature=0, max_tokens=20,
                                 structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"]))
    outs = spec.generate(PROMPTS + ["Answer yes or no: is the sky blue?"], [GREEDY] * len(PROMPTS) + [constrained],
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:-1]] == [r.token_ids for r in reference]
    assert outs[-1].outputs[0].text in ("yes", "no", "maybe")
    assert spec.engine.kv_manager.prefix_hits > hits_before


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "quote": {"type": "string"}},
          "required": ["name", "quote"], "additionalProperties": False}


def test_json_schema_with_drafts_parses_50_times_in_a_row(spec, base):
    """Constrained requests speculate: the grammar takes each draft run up to its first refused token
    and masks every verify row with its state after the drafts before it. 50 schema requests whose
    answers quote their prompt: every output parses and matches the schema, drafts were accepted,
    and the first 8 equal speculation off token for token."""
    import json
    names = ["Alice", "Bob", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana", "Ines", "Jonas"]
    prompts = [f"Return JSON with the name and the exact quote. Name: {names[i % 10]} {i}. Quote: "
               f"'the quick brown fox number {i} jumps over the lazy dog'. JSON:" for i in range(50)]
    params = SamplingParams(temperature=0, max_tokens=48,
                            structured_outputs=StructuredOutputsParams(json=PERSON))
    accepted_before = spec_counters(spec)[1]
    outs = spec.generate(prompts, params, use_tqdm=False)
    for o in outs:
        value = json.loads(o.outputs[0].text)
        assert set(value) == {"name", "quote"} and all(isinstance(v, str) for v in value.values())
    assert spec_counters(spec)[1] > accepted_before
    off = base.generate(prompts[:8], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:8]] == [o.outputs[0].token_ids for o in off]
    assert spec.engine.kv_manager.pool.is_whole()


def test_draft_model_equal_to_the_target_accepts_everything(reference):
    """The default model drafting for itself: greedy tokens equal speculation off, every draft accepted
    (with logprobs, and n = 2 sampled with a seed: equal draws, so q = p and nothing is rejected)."""
    llm = LLM(None, speculative_config={"method": "draft_model", "model": "default", "num_speculative_tokens": 3},
              **SMALL)
    outs = llm.generate(PROMPTS[1:3], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r.token_ids for r in reference[1:3]]
    drafted, accepted = spec_counters(llm)
    assert drafted == accepted > 0
    sampled = llm.generate(PROMPTS[2], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, n=2, seed=5),
                           use_tqdm=False)[0].outputs
    assert [len(o.token_ids) for o in sampled] == [12, 12]
    assert spec_counters(llm)[0] == spec_counters(llm)[1]
    # the proposal forwards through the decode-graph buffers and backend hooks (replayed on CUDA)
    llm.engine.core.executor.runner.drafter.setup_graphs([2, 4], SMALL["max_model_len"], use_graphs=False)
    outs = llm.generate(PROMPTS[1:3], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r.token_ids[:16] for r in reference[1:3]]
    assert spec_counters(llm)[0] == spec_counters(llm)[1]
    assert llm.engine.kv_manager.pool.is_whole()


def test_async_scheduling_and_preemptions(reference):
    """A pool of 12 blocks of 16 tokens for four ~40-token prompts growing to ~72: preemptions happen
    while drafts are verified."""
    llm = LLM(None, speculative_config=NGRAM, async_scheduling=True, num_blocks=12,
              **{k: v for k, v in SMALL.items() if k != "cpu_kv_cache_gib"})
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r.token_ids for r in reference]
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert spec_counters(llm)[1] > 0
    assert llm.engine.kv_manager.pool.is_whole()


# -- sampling: the distribution equals speculation off --------------------------------------------
VOCAB = 16
SAMPLES = 4000


def _tiny(tmp_path_factory, seed: int) -> str:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny-spec"), load_tokenizer(None), num_kv_heads=2,
                               tie=True, seed=seed, vocab_size=VOCAB, initializer_range=0.05)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return _tiny(tmp_path_factory, 3)


@pytest.fixture(scope="module")
def tiny_draft_dir(tmp_path_factory):
    """Another random model of the same shape: a draft whose q differs from the target's p."""
    return _tiny(tmp_path_factory, 4)


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


@pytest.fixture(scope="module")
def tiny_off(tiny_dir):
    return _tokens_2_3(LLM(tiny_dir, **TINY))


TINY = dict(max_model_len=64, cpu_kv_cache_gib=0.05, max_num_seqs=256, tokenizer=None, seed=0)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampling_distribution_equals_speculation_off(tiny_dir, tiny_draft_dir, tiny_off, method):
    # a fixed k: the batch of 500 would turn the adaptive plan off (the sampler's exactness is tested)
    cfg = {"method": method, "num_speculative_tokens": 2, "adaptive": False}
    if method == "draft_model":
        cfg["model"] = tiny_draft_dir
    spec_llm = LLM(tiny_dir, speculative_config=cfg, **TINY)
    on, off = _tokens_2_3(spec_llm), tiny_off
    assert spec_counters(spec_llm)[1] > 50  # drafts were accepted: some third tokens came from one
    assert _two_sample_p(off[:, 0], on[:, 0]) > 1e-3
    assert _two_sample_p(off[:, 1], on[:, 1]) > 1e-3



def test_lora_mixed_batch(tmp_path):
    """Two adapters and the base model in one batch, n-gram drafts verified with each token's own
    adapter: the greedy tokens equal speculation off's."""
    from transformers import AutoModelForCausalLM

    from splitserve import LoRARequest
    from tests.lora_reference import make_peft_adapter
    tok = load_tokenizer(None)
    path = make_tiny_llama_dir(tmp_path / "base", tok, num_kv_heads=2, tie=False, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    loras = [LoRARequest(f"a{i}", i + 1, make_peft_adapter(hf, tmp_path / f"a{i}", rank=8, alpha=16, seed=100 + i,
                                                           magnitude=0.1)) for i in range(2)]
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9], [30, 31, 30, 31, 30]] * 2
    plan = [loras[0], loras[1], None, None, loras[0], loras[1]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    kw = dict(num_blocks=128, enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=128)
    off = LLM(path, **kw).generate(prompts, params, use_tqdm=False, lora_request=plan)
    llm = LLM(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **kw)
    on = llm.generate(prompts, params, use_tqdm=False, lora_request=plan)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert spec_counters(llm)[1] > 0
    assert llm.engine.kv_manager.pool.is_whole()


@pytest.mark.parametrize("variant", ["plain", "async_preempt"])
def test_tiny_draft_model_greedy_equals_speculation_off(tiny_dir, tiny_draft_dir, variant):
    """A draft that differs from the target (drafts partly rejected): greedy tokens still equal, also
    with async scheduling and a pool small enough for preemptions (the draft's cache recomputed)."""
    prompts = [{"prompt_token_ids": p} for p in ([1, 5, 6, 7, 5, 6], [1, 2, 3], [9, 9, 9, 9, 4])]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    off = LLM(tiny_dir, **TINY).generate(prompts, params, use_tqdm=False)
    kw = dict(TINY)
    if variant == "async_preempt":
        del kw["cpu_kv_cache_gib"]
        kw.update(async_scheduling=True, num_blocks=5, block_size=8)
    llm = LLM(tiny_dir, speculative_config={"method": "draft_model", "model": tiny_draft_dir,
                                            "num_speculative_tokens": 3}, **kw)
    on = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    drafted, accepted = spec_counters(llm)
    assert 0 < accepted < drafted
    assert llm.engine.kv_manager.pool.is_whole()
    if variant == "async_preempt":
        assert llm.engine.core.scheduler.num_preemptions > 0


# -- the benchmarks' measurement hook: forced acceptance --------------------------------------------
class _FixedDrafts:
    """Always k drafts (token 3): every verify carries k unless max_tokens trims it."""

    def __init__(self, k: int):
        self.k = k

    def propose_many(self, token_ids, rows, lengths):
        return [[3] * self.k for _ in range(len(rows))]


def _forced_run(tiny_dir, prompts, params):
    llm = LLM(tiny_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
              **dict(TINY, max_model_len=256))
    llm.engine.core.executor.runner.proposer = _FixedDrafts(4)
    outs = llm.generate(prompts, params, use_tqdm=False)
    s = llm.engine.core.scheduler
    return llm, [o.outputs[0].token_ids for o in outs], s.spec_num_accepted_tokens / s.spec_num_drafts + 1


def test_forced_acceptance_gives_the_set_length_and_off_changes_nothing(tiny_dir, monkeypatch):
    """SPLITSERVE_SPEC_FORCE_ACCEPT=a (layers/rejection_sampler.py): each draft accepted with
    probability a, so at k = 4 and a = 0.74 the acceptance length is 1 + a + ... + a^4 = 2.99 whatever
    the drafts (here a constant token the target rarely picks). ~1000 verifies: the mean's standard
    error is ~0.05; max_tokens trims the last drafts of each sequence (a small downward bias); the draw
    is seeded, so the check is deterministic. With the variable unset the hook is absent and greedy
    tokens equal speculation off."""
    prompts = [{"prompt_token_ids": [1, 2 + i % 13, 5, 7 + i % 5]} for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    off = [o.outputs[0].token_ids for o in LLM(tiny_dir, **dict(TINY, max_model_len=256)).generate(
        prompts, params, use_tqdm=False)]

    monkeypatch.delenv("SPLITSERVE_SPEC_FORCE_ACCEPT", raising=False)
    llm, tokens, _ = _forced_run(tiny_dir, prompts, params)
    assert llm.engine.core.executor.runner.verifier.force_accept is None
    assert tokens == off

    monkeypatch.setenv("SPLITSERVE_SPEC_FORCE_ACCEPT", "0.74")
    llm, tokens, length = _forced_run(tiny_dir, prompts, params)
    nominal = sum(0.74 ** j for j in range(5))
    assert abs(length - nominal) < 0.15, (length, nominal)
    assert all(len(t) == 200 for t in tokens) and tokens != off  # forced drafts are emitted
    assert llm.engine.kv_manager.pool.is_whole()
