"""T5 / Flan-T5 through the engine vs transformers' T5ForConditionalGeneration on the same random
weights (CPU, torch_ref attention): greedy tokens equal and logprobs close, for a mixed batch of
different encoder lengths (several encoders in one step, others waiting for the budget), under
preemption (both KV groups freed and recomputed), after an abort storm (the pool whole), and
through the HTTP API with the `openai` client."""
import random

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.loading.resolve import load_tokenizer
from tests.t5_reference import assert_like_hf, hf_t5_greedy, make_tiny_t5

NEW_TOKENS = 12

# case -> T5Config overrides: Flan-T5 style (gated-GELU, unscaled decoder output) and T5 v1.0 style
# (ReLU, the decoder output scaled by d_model ** -0.5; transformers 5 reads that off tie_word_embeddings). d_kv * heads != d_model on purpose;
# few buckets and a short max_distance so the logarithmic buckets are reached by the prompts.
CASES = {
    "flan-t5": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False),
    "t5-v1.0": dict(feed_forward_proj="relu", tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def _prompts(vocab: int, lengths: tuple[int, int], n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(*lengths))] for _ in range(n)]


@pytest.fixture(scope="module", params=list(CASES))
def t5_dir(request, tokenizer, tmp_path_factory):
    from transformers import T5ForConditionalGeneration
    path = make_tiny_t5(tmp_path_factory.mktemp(request.param), tokenizer, seed=list(CASES).index(request.param),
                        **CASES[request.param])
    return path, T5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)


def test_t5_mixed_encoder_lengths_match_transformers(t5_dir, tokenizer):
    path, hf = t5_dir
    # Encoder lengths 3..70 with a 96-token budget: several encoders share a step, others wait.
    prompts = _prompts(len(tokenizer), (3, 70), 7, seed=1)
    llm = LLM(path, num_blocks=128, block_size=8, max_num_batched_tokens=96, attention_backend="torch_ref")
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert_like_hf(hf, prompts, outs, NEW_TOKENS)
    assert llm.engine.kv_manager.pool.is_whole()
    # The bias table as the Triton kernels read it: fp32 [heads, distances], rows contiguous.
    table = llm.engine.runner.model.self_attn[0].pos_bias
    assert table.dtype == torch.float32 and table.is_contiguous()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_t5_preemption_and_abort_storm(t5_dir, tokenizer, async_scheduling):
    """A pool too small for the batch (preemptions free both groups; encoders run again) with a
    random subset aborted wherever they are: survivors get transformers' greedy tokens, nothing leaks."""
    path, hf = t5_dir
    rng = random.Random(7)
    prompts = _prompts(len(tokenizer), (3, 40), 12, seed=2)
    llm = LLM(path, num_blocks=16, block_size=8, max_num_batched_tokens=64, max_num_seqs=8,
              attention_backend="torch_ref", async_scheduling=async_scheduling)
    engine = llm.engine
    ids = [engine.add_request(f"r{i}", p, PARAMS, stream=False) for i, p in enumerate(prompts)]
    doomed = set(rng.sample(ids, 4))
    finished, aborted = {}, set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out
        live = [i for i in doomed if i in engine.states]
        for rid in rng.sample(live, min(len(live), rng.randrange(0, 2))):
            engine.abort_request(rid)
            aborted.add(rid)
    assert engine.scheduler.num_preemptions > 0
    survivors = [i for i, rid in enumerate(ids) if rid not in aborted]
    assert_like_hf(hf, [prompts[i] for i in survivors], [finished[ids[i]] for i in survivors], NEW_TOKENS)
    assert engine.kv_manager.pool.is_whole()
    assert not engine.scheduler.requests and not engine.states
    assert not engine.runner.encdec.inputs  # the worker dropped every encoder input


def test_t5_bad_input_is_a_clear_error(t5_dir):
    path, _ = t5_dir
    llm = LLM(path, num_blocks=32, block_size=8, max_num_batched_tokens=32, attention_backend="torch_ref")
    with pytest.raises(ValueError, match="encoder-decoder model runs a request's encoder in one"):
        llm.generate([list(range(3, 40))], PARAMS, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt token ids must be integers"):
        llm.generate([[5, 10 ** 9]], PARAMS, use_tqdm=False)


@torch.inference_mode()
def test_t5_encoder_takes_input_embeddings(t5_dir):
    """`encode_embeds` (BLIP-2's Q-Former output goes in there) vs transformers' encoder on the same
    inputs_embeds, for a ragged batch (each sequence padded and masked to its own length)."""
    from splitserve.models.loader import load_hf_config, load_model
    from splitserve.loading.resolve import resolve_model
    path, hf = t5_dir
    source = resolve_model(path)
    _, model = load_model(source, load_hf_config(source), torch.float32, "cpu")
    g = torch.Generator().manual_seed(4)
    embeds = [torch.randn(n, hf.config.d_model, generator=g) for n in (5, 17, 9)]
    got = model.encode_embeds(embeds)
    want = torch.cat([hf.encoder(inputs_embeds=e[None]).last_hidden_state[0] for e in embeds])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_t5_decode_graph_path_matches_transformers(t5_dir, tokenizer):
    """The decode-graph path with the cross-attention op inside, run without graphs on CPU: the
    backend's static self- and cross-attention buffers (encoder length 0 in padding rows), their
    refill before each "replay", steps padded up to the graph sizes; encoders run eagerly before."""
    from splitserve.worker.cuda_graphs import DecodeGraphs
    path, hf = t5_dir
    prompts = _prompts(len(tokenizer), (3, 40), 5, seed=3)
    llm = LLM(path, num_blocks=128, block_size=8, max_num_batched_tokens=96, max_num_seqs=5)
    runner = llm.engine.runner
    m = runner.config.model
    runner.graphs = DecodeGraphs(runner.model, runner.backend, [2, 4, 8], runner.max_blocks_per_seq,
                                 m.max_model_len, runner.kv_layout()[1], runner.device, use_graphs=False,
                                 cross_blocks=runner.encdec.cross_table.shape[1], block_size=runner.block_size)
    calls = []
    run_graph = runner.graphs.run
    runner.graphs.run = lambda num_seqs, *a: calls.append(num_seqs) or run_graph(num_seqs, *a)
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert_like_hf(hf, prompts, outs, NEW_TOKENS)
    assert {3, 5} & set(calls) and runner.steps_by_path["decode_graph"] == len(calls)  # padded rows replayed
    assert llm.engine.kv_manager.pool.is_whole()
