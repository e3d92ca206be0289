"""BLIP-2 with an OPT decoder vs transformers on the same random weights.

A prompt without image markers is laid out as transformers' Blip2Processor does (query tokens first,
before BOS) and must equal its input ids. Prompts with `<image>` markers (one image in the middle,
two images) are checked against transformers' model given the same expanded ids and all the
prompt's images (its masked scatter fills the placeholders in order). One batch mixes them with
text-only prompts under a small step budget, so query-token runs are split across prefill chunks.
"""
import pytest
import torch
import transformers

from splitserve import LLM, SamplingParams
from tests.multimodal_reference import IMAGE, mm_tokenizer, random_image
from tests.zoo_reference import (assert_matches_reference, check_prefix_and_encoder_cache_hits, NUM_QUERY,
                                 blip2_processor, hf_greedy, make_tiny_blip2_dir, run_abort_storm)

NEW_TOKENS = 8
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = mm_tokenizer()
    path = make_tiny_blip2_dir(tmp_path_factory.mktemp("blip2") / "m", tok, seed=4)
    hf = transformers.Blip2ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return path, tok, hf, blip2_processor(path, tok)


def expanded_ids(tok, text: str, add_special_tokens: bool = True) -> list[int]:
    """The prompt's ids with each <image> token repeated once per query token (independent of the engine)."""
    image_id = tok.convert_tokens_to_ids(IMAGE)
    out = []
    for t in tok.encode(text, add_special_tokens=add_special_tokens):
        out.extend([t] * NUM_QUERY if t == image_id else [t])
    return out


def reference(setup, text: str, imgs) -> tuple[list[int], list[int], list[float]]:
    _, tok, hf, processor = setup
    if not imgs:
        ids = torch.tensor([tok.encode(text)])
        return (ids[0].tolist(), *hf_greedy(hf.language_model, NEW_TOKENS, input_ids=ids))
    if IMAGE not in text:
        inputs = dict(processor(images=imgs, text=text, return_tensors="pt"))
    else:
        pixels = processor.image_processor(images=imgs, return_tensors="pt")["pixel_values"]
        inputs = {"input_ids": torch.tensor([expanded_ids(tok, text)]), "pixel_values": pixels}
    return (inputs["input_ids"][0].tolist(), *hf_greedy(hf, NEW_TOKENS, **inputs))


PROMPTS = [
    ("Question: what is shown here? Answer:", [(80, 60)]),      # no marker: images first
    ("The quick brown fox jumps over the lazy dog.", []),
    ("Look at <image> and say what it is.", [(50, 90)]),
    ("Compare <image> with <image> please.", [(64, 64), (120, 40)]),
    ("Question: and here? Answer:", [(64, 64)]),                # the same picture again: encoder cache
]


def test_greedy_parity_mixed_batch(setup):
    path = setup[0]
    images = [[random_image(10 * i + j, size) for j, size in enumerate(sizes)] for i, (_, sizes) in enumerate(PROMPTS)]
    images[4] = [images[3][0]]
    llm = LLM(path, num_blocks=128, block_size=16, max_num_batched_tokens=24)
    requests = [{"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text
                for (text, _), imgs in zip(PROMPTS, images)]
    outs = llm.generate(requests, PARAMS, use_tqdm=False)
    for (text, _), imgs, out in zip(PROMPTS, images, outs):
        assert_matches_reference(out, reference(setup, text, imgs), text)
    # the image matters: same text, another picture, other logits
    assert outs[0].outputs[0].logprobs[0] != llm.generate(
        {"prompt": PROMPTS[0][0], "multi_modal_data": {"image": random_image(99, (80, 60))}}, PARAMS,
        use_tqdm=False)[0].outputs[0].logprobs[0]
    assert llm.engine.runner.mm.num_images_encoded == 5  # 4 distinct in the batch (one repeated) + 1
    assert llm.engine.kv_manager.pool.is_whole() and llm.engine.runner.mm.cache.is_whole()


def test_prefix_and_encoder_cache_hits(setup):
    check_prefix_and_encoder_cache_hits(
        setup[0], 'Question: describe the picture in some detail, please? Answer:', 'Another question? Answer:',
        256, PARAMS,
        lambda text, imgs: reference(setup, text, imgs)[1])


def test_abort_storm_leaves_pool_and_encoder_cache_whole(setup):
    def prompts(mm, rng):
        pool = [mm.process_image(random_image(200 + i, (40 + 7 * i, 60))) for i in range(4)]
        for i in range(18):
            if i % 3 == 1:
                yield mm.tokenize(f"Plain text about robot number {i}.")
            elif i % 3 == 0:
                yield mm.build_prompt(f"Question {i}: what? Answer:", rng.sample(pool, 1))
            else:
                yield mm.build_prompt(f"See <image> then <image> now {i}.", rng.sample(pool, 2))
    run_abort_storm(setup[0], prompts)


def test_piecewise_graph_path_matches_transformers(setup):
    from tests.zoo_reference import generate_on_piecewise_path
    images = [[random_image(70 + j, size) for j, size in enumerate(sizes)] for _, sizes in PROMPTS[:2]]
    requests = [{"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text
                for (text, _), imgs in zip(PROMPTS[:2], images)]
    outs = generate_on_piecewise_path(setup[0], requests, PARAMS)
    for (text, _), imgs, out in zip(PROMPTS[:2], images, outs):
        assert out.outputs[0].token_ids == reference(setup, text, imgs)[1], text
