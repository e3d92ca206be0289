"""prompt_logprobs on the real default model vs transformers' log-softmax over the same prompt.

The engine runs with a step budget of 8 tokens, so every prompt here is prefilled in several chunks
(each chunk gives its own piece of the prompt logprobs), and with prefix caching on (a request that
asks for prompt logprobs must recompute a cached prefix, as in vLLM)."""
import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.loading.resolve import default_model_source

BUDGET = 8
PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the dark forest."


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_batched_tokens=BUDGET, max_model_len=512, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM
    src = default_model_source()
    return AutoModelForCausalLM.from_pretrained(src.directory, gguf_file=src.gguf_file, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: row i is the log-softmax that predicts ids[i + 1]."""
    logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def check_against_reference(prompt_logprobs, ids, ref: torch.Tensor, k: int, tokenizer) -> None:
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        entry, row, token = prompt_logprobs[i], ref[i - 1], ids[i]
        assert entry[token] == pytest.approx(row[token].item(), abs=1e-3)
        # its rank, up to tokens whose logprobs lie within float error of its own
        assert int((row > row[token] + 1e-4).sum()) + 1 <= entry[token].rank <= int((row > row[token] - 1e-4).sum()) + 1
        top_vals, top_ids = row.topk(k)
        for t, v in zip(top_ids.tolist(), top_vals.tolist()):
            assert entry[t] == pytest.approx(v, abs=1e-3)
        assert set(entry) == set(top_ids.tolist()) | {token}
        assert all(lp.decoded_token == tokenizer.decode([t], skip_special_tokens=False) for t, lp in entry.items())


def test_chunked_prompt_logprobs_match_transformers(llm, hf_model):
    ids = llm.get_tokenizer().encode(PROMPT)
    assert len(ids) > 2 * BUDGET  # three chunks at least
    out = llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=3), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    check_against_reference(out.prompt_logprobs, ids, hf_prompt_logprobs(hf_model, ids), 3, llm.get_tokenizer())
    assert llm.engine.kv_manager.pool.is_whole()


def test_cached_prefix_is_recomputed_for_prompt_logprobs(llm, hf_model):
    prompt = PROMPT + " A second sentence follows."
    plain = llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None
    hits = llm.engine.kv_manager.prefix_hits
    again = llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and llm.engine.kv_manager.prefix_hits > hits  # the cache holds it
    out = llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    ids = out.prompt_token_ids
    check_against_reference(out.prompt_logprobs, ids, hf_prompt_logprobs(hf_model, ids), 0, llm.get_tokenizer())
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids


def test_mixed_batch_leaves_other_requests_alone(llm, hf_model):
    others = ["Hello, my name is", "List three colours:", PROMPT[::-1]]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(others, greedy, use_tqdm=False)]
    with_plp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate(others + [PROMPT], [greedy] * 3 + [with_plp], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:3]] == alone
    assert all(o.prompt_logprobs is None for o in outs[:3])
    ids = outs[3].prompt_token_ids
    check_against_reference(outs[3].prompt_logprobs, ids, hf_prompt_logprobs(hf_model, ids), 2, llm.get_tokenizer())
    assert llm.engine.kv_manager.pool.is_whole()


def test_one_token_prompt_and_parallel_samples(llm):
    bos_only = [llm.get_tokenizer().encode("Hi")[0]]
    out = llm.generate({"prompt_token_ids": bos_only}, SamplingParams(max_tokens=2, prompt_logprobs=1),
                       use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]
    out = llm.generate(PROMPT, SamplingParams(max_tokens=2, n=3, temperature=1.0, seed=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 3 and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert llm.engine.kv_manager.pool.is_whole()


def test_bad_values_are_errors():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_async_scheduling_and_preemption_on_a_tiny_model(tmp_path):
    """Steps overlapped (async scheduling, on CPU here) and a KV cache so small that requests are
    preempted mid-prompt and recomputed: prompt logprobs still equal transformers'."""
    from transformers import LlamaForCausalLM

    from splitserve.loading.resolve import load_tokenizer
    from tests.hf_reference import make_tiny_llama_dir
    model_dir = make_tiny_llama_dir(tmp_path / "tiny", load_tokenizer(None), num_kv_heads=2, tie=False, seed=5)
    llm = LLM(model_dir, max_num_batched_tokens=BUDGET, max_model_len=128, async_scheduling=True, block_size=8,
              num_blocks=12, dtype="float32")
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [PROMPT, PROMPT[::-1], "Numbers: " + " ".join(map(str, range(20)))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for out in outs:
        ids = out.prompt_token_ids
        check_against_reference(out.prompt_logprobs, ids, hf_prompt_logprobs(hf, ids), 1, llm.get_tokenizer())
    assert llm.engine.kv_manager.pool.is_whole()
