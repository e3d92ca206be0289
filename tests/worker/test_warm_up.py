"""The start-up warm-up must reach every compile-time variant of the ragged attention kernel that a
step can pick, or the first request of that shape compiles a kernel while serving."""
from __future__ import annotations

import pytest

from splitserve.kernels.attention.paged_attention import ragged_variant
from splitserve.worker.model_runner import warm_up_layouts


def _all_variants(budget: int, heads: int, kv_heads: int, head_dim: int) -> set:
    out = set()
    for q in range(1, budget + 1):
        out.add(ragged_variant(q, 1, q, q, heads, kv_heads, head_dim))          # a fresh prompt of q tokens
        out.add(ragged_variant(q, 1, q, q + 16, heads, kv_heads, head_dim))     # a chunk after context
    return out


@pytest.mark.parametrize("budget,heads,kv_heads,head_dim,block_size", [
    (16384, 32, 8, 128, 16),   # Llama-3-8B shape at the benchmarks' token budget
    (8192, 9, 3, 64, 16),      # the default model (SmolLM2-135M) at the default budget
    (512, 8, 2, 64, 16), (64, 4, 4, 128, 32), (8, 4, 1, 64, 16),
])
def test_warm_up_reaches_every_ragged_variant(budget, heads, kv_heads, head_dim, block_size):
    warmed = {ragged_variant(n * q, n, q, q + ctx, heads, kv_heads, head_dim)
              for n, q, ctx in warm_up_layouts(budget, block_size)}
    assert warmed == _all_variants(budget, heads, kv_heads, head_dim)


def test_warm_up_fits_the_token_budget_and_never_runs_one_token():
    for budget in (1, 2, 8, 100, 512, 16384):
        assert all(1 < n * q <= budget for n, q, _ in warm_up_layouts(budget, 16))


def test_warm_up_steps_run_and_leave_the_cache_untouched(tmp_path):
    """The warm-up layouts run end to end (here on the CPU reference backend) and, writing to slot -1
    only, leave every KV block as it was; the engine still generates afterwards."""
    import torch

    from splitserve import LLM, SamplingParams
    from splitserve.loading.resolve import load_tokenizer
    from tests.hf_reference import make_tiny_llama_dir
    llm = LLM(make_tiny_llama_dir(tmp_path, load_tokenizer(None), num_kv_heads=2, tie=False),
              num_blocks=64, max_num_batched_tokens=128)
    runner = llm.engine.runner
    g = torch.Generator(device=runner.kv_caches[0].device).manual_seed(0)
    for cache in runner.kv_caches:
        cache.normal_(generator=g)
    before = [c.clone() for c in runner.kv_caches]
    runner._warm_up_eager()
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches))
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
