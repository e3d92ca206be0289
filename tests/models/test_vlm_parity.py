"""LLaVA (CLIP and SigLIP towers) and LLaVA-NeXT vs transformers on the same random weights.

One splitserve batch mixes text-only prompts with prompts of one and two images; a small token
budget chunks the prefills, so image placeholder runs are split across steps. Every prompt is run
alone through the HF model with the HF processor's own placeholder expansion: splitserve's expanded
prompt, greedy tokens and log-probabilities must match it.
"""
import pytest
import torch
import transformers

from splitserve import LLM, SamplingParams
from tests.multimodal_reference import hf_greedy_mm, hf_processor, make_tiny_llava_dir, mm_tokenizer, random_image

NEW_TOKENS = 12

CASES = {
    "llava-clip": dict(tower="clip", anyres=False),
    "llava-siglip": dict(tower="siglip", anyres=False),
    "llava-next-clip": dict(tower="clip", anyres=True),
}

# (text, image sizes as (width, height)); sizes differ so LLaVA-NeXT picks different grids.
PROMPTS = [
    ("The quick brown fox jumps over the lazy dog.", []),
    ("USER: <image>\nWhat is shown here? ASSISTANT:", [(80, 60)]),
    ("Compare <image> with <image> please.", [(50, 90), (64, 64)]),
    ("Tell me a story about a robot.", []),
    ("<image> Describe it.", [(120, 40)]),
]


@pytest.fixture(scope="module")
def tokenizer():
    return mm_tokenizer()


@pytest.mark.parametrize("case", list(CASES))
def test_vlm_greedy_parity_with_transformers(case, tokenizer, tmp_path):
    spec = CASES[case]
    path = make_tiny_llava_dir(tmp_path / case, tokenizer, seed=len(case), **spec)
    cls = transformers.LlavaNextForConditionalGeneration if spec["anyres"] else transformers.LlavaForConditionalGeneration
    hf = cls.from_pretrained(path, dtype=torch.float32).eval()
    processor = hf_processor(path, tokenizer, spec["tower"], spec["anyres"])

    images = [[random_image(10 * i + j, size) for j, size in enumerate(sizes)] for i, (_, sizes) in enumerate(PROMPTS)]
    llm = LLM(path, num_blocks=128, block_size=16, max_num_batched_tokens=48)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    requests = [{"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text
                for (text, _), imgs in zip(PROMPTS, images)]
    outs = llm.generate(requests, params, use_tqdm=False)

    for (text, _), imgs, out in zip(PROMPTS, images, outs):
        inputs = processor(text=text, images=imgs or None, return_tensors="pt")
        assert out.prompt_token_ids == inputs["input_ids"][0].tolist(), "placeholder expansion differs"
        ref_tokens, ref_logprobs = hf_greedy_mm(hf, dict(inputs), NEW_TOKENS)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, text
        got_logprobs = [lp[t] for lp, t in zip(got.logprobs, got.token_ids)]
        assert got_logprobs == pytest.approx(ref_logprobs, abs=5e-4)

    assert llm.engine.kv_manager.pool.is_whole()
    assert llm.engine.runner.mm.cache.is_whole()
    # 4 distinct images, each encoded once although their placeholder runs span several steps
    assert llm.engine.runner.mm.num_images_encoded == 4


def test_vlm_steps_take_the_piecewise_graph_path(tokenizer, tmp_path):
    # The piecewise-graph path without graphs on CPU (same segments, static buffers, padding to
    # buckets as on the GPU): steps with image tokens start segment 0 from the embeddings buffer,
    # text-only steps from the token ids, and both must give transformers' tokens.
    from splitserve.worker.cuda_graphs import PiecewiseGraphs
    path = make_tiny_llava_dir(tmp_path / "pw", tokenizer, seed=7, tower="clip", anyres=False)
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processor = hf_processor(path, tokenizer, "clip", False)
    llm = LLM(path, num_blocks=128, block_size=16, max_num_batched_tokens=48)
    runner = llm.engine.runner
    runner.piecewise = PiecewiseGraphs(runner.model, [8, 32], runner.device, use_graphs=False)
    assert runner.piecewise.accepts_embeds
    calls = []
    run_segments = runner.piecewise.run
    runner.piecewise.run = lambda *a: calls.append(a[3] is not None) or run_segments(*a)

    images = [[random_image(10 * i + j, size) for j, size in enumerate(sizes)] for i, (_, sizes) in enumerate(PROMPTS)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    requests = [{"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text
                for (text, _), imgs in zip(PROMPTS, images)]
    outs = llm.generate(requests, params, use_tqdm=False)
    for (text, _), imgs, out in zip(PROMPTS, images, outs):
        inputs = processor(text=text, images=imgs or None, return_tensors="pt")
        assert out.outputs[0].token_ids == hf_greedy_mm(hf, dict(inputs), NEW_TOKENS)[0], text
    assert True in calls and False in calls  # steps with and without image tokens replayed
    assert runner.steps_by_path["piecewise"] == len(calls)
    assert llm.engine.kv_manager.pool.is_whole() and runner.mm.cache.is_whole()
