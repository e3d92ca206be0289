"""Tensor parallelism of the encoder-decoder models: two ranks (one worker process each, gloo on CPU)
behind the offline LLM, each loading its part with the ordinary loader (lazy safetensors slices):
its heads of every attention (q/k/v columns, o rows, the relative attention bias table's columns,
its KV cache and cross blocks), its columns of wi and rows of wo, its vocabulary rows of the
embedding and head. T5 and Pix2Struct give transformers' greedy tokens and logprobs, and TP=1's.

That the ranks really split the heads shows in the KV pool: with the same KV memory per rank, a rank
that caches half the heads holds twice the blocks."""
from __future__ import annotations

import pytest
import torch

from splitserve import LLM, SamplingParams

pytestmark = pytest.mark.slow  # spawns rank processes

KV = dict(cpu_kv_cache_gib=0.004, block_size=8, attention_backend="torch_ref")


def _tokens_and_logprobs(outs):
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def _run(path: str, prompts, params, tp: int, **kw):
    llm = LLM(path, tensor_parallel_size=tp, **KV, **kw)
    try:
        return _tokens_and_logprobs(llm.generate(prompts, params, use_tqdm=False)), \
            llm.engine.kv_manager.pool.num_blocks
    finally:
        if tp > 1:
            llm.engine.core.shutdown()


def _assert_same(got, want, atol: float = 1e-4) -> None:
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, want, strict=True):
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=atol, rtol=0)


def test_t5_two_ranks_match_one_and_transformers(tmp_path):
    """Flan-T5's shape (gated-GELU, relative bias over 8 buckets reached by the prompts): 4 heads, 2
    per rank; a vocabulary split over the ranks (the head tied to the embedding)."""
    import random

    from transformers import T5ForConditionalGeneration

    from splitserve.loading.resolve import load_tokenizer
    from tests.t5_reference import hf_t5_greedy, make_tiny_t5
    tok = load_tokenizer(None)
    path = make_tiny_t5(tmp_path / "t5", tok, seed=2, feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, len(tok)) for _ in range(n)] for n in (6, 31, 17)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    two, blocks2 = _run(path, prompts, params, 2, max_num_batched_tokens=64)
    one, blocks1 = _run(path, prompts, params, 1, max_num_batched_tokens=64)
    _assert_same(two, one)
    hf = T5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    _assert_same(two, [hf_t5_greedy(hf, p, 8) for p in prompts], atol=2e-4)
    assert blocks2 // 2 == blocks1  # (rounded down from the same memory)


def test_pix2struct_two_ranks_match_one_and_transformers(tmp_path):
    """Deplot's shape: the vision encoder's and the text decoder's 4 heads, 2 per rank; charts of
    different patch grids (ragged encoder lengths in one step) and headers."""
    from splitserve.models.pix2struct.processor import DEPLOT_PROMPT
    from tests.pix2struct_reference import bar_chart, hf_greedy, make_tiny_deplot
    path, hf, processor = make_tiny_deplot(tmp_path / "deplot")
    cases = [(bar_chart([0.3, 0.9, 0.5], (120, 80)), DEPLOT_PROMPT),
             (bar_chart([0.5, 0.5], (200, 60), seed=2), "What is the value of bar B?")]
    prompts = [{"prompt": h, "multi_modal_data": {"image": img}} for img, h in cases]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    two, blocks2 = _run(path, prompts, params, 2, max_num_batched_tokens=256)
    one, blocks1 = _run(path, prompts, params, 1, max_num_batched_tokens=256)
    _assert_same(two, one)
    _assert_same([(t[:8], lp[:8]) for t, lp in two], [tuple(x[:8] for x in hf_greedy(hf, processor, img, h))
                                                       for img, h in cases], atol=2e-4)
    assert blocks2 // 2 == blocks1  # (rounded down from the same memory)
