"""T5 / Flan-T5 through the engine vs transformers' T5ForConditionalGeneration on the same random
weights (CPU, torch_ref attention): greedy tokens equal and logprobs close, for a mixed batch of
different encoder lengths (several encoders in one step, others waiting for the budget), under
preemption (both KV groups freed and recomputed), after an abort storm (the pool whole), and
through the HTTP API with the `openai` client."""
import random

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.models.resolve import load_tokenizer

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


def make_tiny_t5(path, tokenizer, seed: int, **overrides) -> str:
    from transformers import T5Config, T5ForConditionalGeneration
    config = T5Config(vocab_size=len(tokenizer), d_model=64, d_kv=8, d_ff=96, num_layers=3, num_decoder_layers=2,
                      num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=20,
                      dropout_rate=0.0, initializer_factor=1.5, decoder_start_token_id=0, pad_token_id=0,
                      eos_token_id=tokenizer.eos_token_id, **overrides)
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(config).eval()
    with torch.no_grad():  # norms start as ones: make them matter too
        for name, param in model.named_parameters():
            if "layer_norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@torch.inference_mode()
def hf_t5_greedy(model, encoder_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    ids = torch.tensor([encoder_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         min_new_tokens=max_new_tokens, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, 1:].tolist()  # after the decoder start token
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, tokens)]
    return tokens, logprobs


def assert_like_hf(hf, prompts, outs, atol=2e-4):
    for prompt, out in zip(prompts, outs, strict=True):
        ref_tokens, ref_logprobs = hf_t5_greedy(hf, prompt, NEW_TOKENS)
        comp = out.outputs[0]
        assert comp.token_ids == ref_tokens, f"encoder length {len(prompt)}"
        got = [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)]
        assert got == pytest.approx(ref_logprobs, abs=atol)
        assert max(abs(x) for x in ref_logprobs) > 1e-2, "saturated logits would make the logprob check vacuous"


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
    assert_like_hf(hf, prompts, outs)
    assert llm.engine.kv_manager.pool.is_whole()
