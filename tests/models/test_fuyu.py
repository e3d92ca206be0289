"""Fuyu vs transformers on the same random weights: patch grids of different shapes (smaller than
the canvas, and larger ones scaled down), |NEWLINE| row ends, FuyuProcessor's prompt layout for a
prompt without image markers, and `<image>` markers for several images in one prompt (transformers'
model given the same ids and all the prompt's patches). One batch mixes them with a text-only
prompt under a small step budget, so image runs are split across prefill chunks."""
import pytest
import torch
import transformers

from splitserve import LLM, SamplingParams
from tests.multimodal_reference import random_image
from tests.zoo_reference import (assert_matches_reference, check_prefix_and_encoder_cache_hits,
                                 fuyu_reference_inputs, fuyu_tokenizer, hf_greedy, make_tiny_fuyu_dir,
                                 run_abort_storm)

NEW_TOKENS = 8
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = fuyu_tokenizer()
    path = make_tiny_fuyu_dir(tmp_path_factory.mktemp("fuyu") / "m", tok, seed=6)
    hf = transformers.FuyuForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, tok, hf


def reference(setup, text: str, imgs) -> tuple[list[int], list[int], list[float]]:
    path, tok, hf = setup
    if not imgs:
        ids = torch.tensor([tok.encode(text)])
        return (ids[0].tolist(), *hf_greedy(hf, NEW_TOKENS, input_ids=ids))
    if "<image>" not in text:
        assert len(imgs) == 1
        inputs = fuyu_reference_inputs(path, tok, text, imgs[0])
    else:  # each marker becomes the image's rows (FuyuProcessor's run without its trailing BOS)
        ids, patches = [], []
        for i, piece in enumerate(text.split("<image>")):
            if i:
                one = fuyu_reference_inputs(path, tok, "", imgs[i - 1])
                run = one["input_ids"][0].tolist()
                ids.extend(run[:run.index(tok.bos_token_id)])
                patches.append(one["pixel_values"])
            ids.extend(tok.encode(piece, add_special_tokens=i == 0))
        inputs = {"input_ids": torch.tensor([ids]), "pixel_values": torch.cat(patches, dim=1)}
    return (inputs["input_ids"][0].tolist(), *hf_greedy(hf, NEW_TOKENS, **inputs))


PROMPTS = [
    ("Generate a coco-style caption.\n", [(80, 50)]),               # 4 x 6 patches
    ("The quick brown fox jumps over the lazy dog.", []),
    ("What is in the picture?\n", [(200, 100)]),                     # scaled to 90 x 45: 3 x 6
    ("Compare <image> with <image> please.", [(31, 44), (90, 16)]),  # 3 x 3 and 2 x 6
    ("Describe it.\n", [(20, 61)]),                                  # taller than the canvas: 19 x 60, 4 x 2
]


def test_greedy_parity_mixed_batch(setup):
    path = setup[0]
    images = [[random_image(10 * i + j, size) for j, size in enumerate(sizes)] for i, (_, sizes) in enumerate(PROMPTS)]
    llm = LLM(path, num_blocks=128, block_size=16, max_num_batched_tokens=24)
    requests = [{"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text
                for (text, _), imgs in zip(PROMPTS, images)]
    outs = llm.generate(requests, PARAMS, use_tqdm=False)
    for (text, _), imgs, out in zip(PROMPTS, images, outs):
        assert_matches_reference(out, reference(setup, text, imgs), text)
    assert llm.engine.runner.mm.num_images_encoded == 5
    assert llm.engine.kv_manager.pool.is_whole() and llm.engine.runner.mm.cache.is_whole()


def test_prefix_and_encoder_cache_hits(setup):
    check_prefix_and_encoder_cache_hits(
        setup[0], 'Describe the picture in some detail, please.', 'Another question?', 256, PARAMS,
        lambda text, imgs: reference(setup, text, imgs)[1])


def test_abort_storm_leaves_pool_and_encoder_cache_whole(setup):
    def prompts(mm, rng):
        pool = [mm.process_image(random_image(300 + i, (30 + 11 * i, 45))) for i in range(4)]
        for i in range(18):
            if i % 3 == 1:
                yield mm.tokenize(f"Plain text about robot number {i}.")
            elif i % 3 == 0:
                yield mm.build_prompt(f"Question {i}: what?", rng.sample(pool, 1))
            else:
                yield mm.build_prompt(f"See <image> then <image> now {i}.", rng.sample(pool, 2))
    run_abort_storm(setup[0], prompts, num_blocks=16)


def test_piecewise_graph_path_matches_transformers(setup):
    from tests.zoo_reference import generate_on_piecewise_path
    images = [[random_image(70 + j, size) for j, size in enumerate(sizes)] for _, sizes in PROMPTS[:2]]
    requests = [{"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text
                for (text, _), imgs in zip(PROMPTS[:2], images)]
    outs = generate_on_piecewise_path(setup[0], requests, PARAMS)
    for (text, _), imgs, out in zip(PROMPTS[:2], images, outs):
        assert out.outputs[0].token_ids == reference(setup, text, imgs)[1], text
