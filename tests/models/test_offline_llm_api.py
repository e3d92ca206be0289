"""The offline `LLM` as vLLM's: get_tokenizer(), the model's generation-config defaults when no sampling
params are given (get_default_sampling_params), logprobs as Logprob objects (logprob, rank,
decoded_token) checked against transformers' distribution, chat(chat_template=...), and --seed."""
from __future__ import annotations

import json
import random

import jinja2
import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.loading.resolve import load_tokenizer
from tests.hf_reference import hf_greedy, make_tiny_llama_dir

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = make_tiny_llama_dir(tmp_path_factory.mktemp("offline") / "m", load_tokenizer(None), num_kv_heads=2,
                               tie=True, seed=5)
    with open(f"{path}/generation_config.json") as f:
        cfg = json.load(f)
    with open(f"{path}/generation_config.json", "w") as f:
        json.dump({**cfg, "temperature": 0.0, "max_new_tokens": 9}, f)
    return path


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, num_blocks=64, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 30))] for _ in range(3)]


def test_get_tokenizer(llm, model_dir):
    tok = llm.get_tokenizer()
    assert tok is llm.engine.tokenizer
    from transformers import AutoTokenizer
    assert tok.encode("Hello there") == AutoTokenizer.from_pretrained(model_dir).encode("Hello there")


def test_without_params_requests_take_the_generation_config(llm, hf):
    defaults = llm.get_default_sampling_params()
    assert defaults.temperature == 0.0 and defaults.max_tokens == 9
    for prompt, out in zip(ps := prompts(len(llm.get_tokenizer())), llm.generate(ps, use_tqdm=False)):
        ref, _ = hf_greedy(hf, prompt, 9)
        got = out.outputs[0].token_ids
        assert got == ref[:len(got)] and (len(got) == 9 or got[-1] in llm.engine.config.model.eos_token_ids)


def test_generation_config_vllm_keeps_sampling_params_defaults(model_dir):
    other = LLM(model_dir, num_blocks=16, generation_config="vllm")
    assert other.get_default_sampling_params() == SamplingParams()


@torch.inference_mode()
def test_logprobs_are_objects_with_rank_and_text(llm, hf):
    tok = llm.get_tokenizer()
    prompt = prompts(len(tok))[0]
    params = SamplingParams(max_tokens=6, temperature=1.5, seed=11, logprobs=3, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    ids = torch.tensor([prompt + out.token_ids])
    ref = torch.log_softmax(hf(ids).logits[0].float(), -1)[len(prompt) - 1:-1]  # the distribution of each output
    assert len(out.logprobs) == len(out.token_ids) == len(ref)
    ranks_beyond_top = 0
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert list(entry)[0] == token
        top = ref[step].topk(3).indices.tolist()
        assert set(entry) == {token, *top}
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(ref[step, t].item(), abs=1e-4)
            assert lp.rank == int((ref[step] > ref[step, t]).sum()) + 1
            assert lp.decoded_token == tok.decode([t])
        ranks_beyond_top += entry[token].rank > 3
    assert ranks_beyond_top > 0  # at temperature 1.5 some sampled token ranks below the top 3


def test_chat_with_a_template_of_its_own(llm):
    messages = [{"role": "user", "content": "hi there"}]
    out = llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False, chat_template=TEMPLATE)[0]
    expected = llm.get_tokenizer().encode(jinja2.Template(TEMPLATE).render(messages=messages),
                                          add_special_tokens=False)
    assert out.prompt_token_ids == expected


TOOLS_TEMPLATE = ("{% if tools %}[tools] {% for t in tools %}{{ t.function.name }} {% endfor %}| {% endif %}"
                  + TEMPLATE)


def test_chat_gives_tools_to_the_template(llm):
    messages = [{"role": "user", "content": "weather?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    out = llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False, chat_template=TOOLS_TEMPLATE,
                   tools=tools)[0]
    expected = llm.get_tokenizer().encode("[tools] get_weather | [user] weather?\n[assistant]",
                                          add_special_tokens=False)
    assert out.prompt_token_ids == expected


def test_seed_makes_unseeded_sampling_repeat(model_dir):
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    prompt = [[5, 6, 7, 8]]

    def run(seed):
        llm = LLM(model_dir, num_blocks=16, seed=seed)
        return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    first = run(123)
    assert run(123) == first
    assert run(124) != first
