"""The real default model (SmolLM2-135M-Instruct GGUF): splitserve vs transformers loading the same file."""
import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.loading.resolve import default_model_source
from tests.hf_reference import hf_greedy

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain in one sentence what a CPU does.",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def llm():
    return LLM()


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM
    src = default_model_source()
    return AutoModelForCausalLM.from_pretrained(src.directory, gguf_file=src.gguf_file, dtype=torch.float32).eval()


def test_greedy_chat_continuations_match_transformers(llm, hf_model):
    prompts = [llm.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_logprobs = hf_greedy(hf_model, prompt, NEW_TOKENS)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens
        assert [lp[t] for lp, t in zip(got.logprobs, got.token_ids)] == pytest.approx(ref_logprobs, abs=1e-3)


def test_capital_of_france_is_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=24, temperature=0))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    # The text is the detokenized tokens, stop token excluded.
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_stop_string_is_trimmed_and_engine_stays_clean(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=24, temperature=0, stop=["Paris"]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "Paris"
    assert "Paris" not in out.text and out.text.startswith("The capital of France is")
    assert llm.engine.kv_manager.pool.is_whole()
