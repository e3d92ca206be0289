"""Kosmos-2 vs transformers on the same random weights: its text decoder as a family of the engine's
decoder, the CLIP-style tower + latent-query resampler, Kosmos2Processor's prompt layout (exact ids,
image slots included), `<image>` markers for images elsewhere and for several images (transformers'
model given the same ids, image_embeds_position_mask and all the prompt's images), and grounding:
location tokens in the output come back as transformers' post-processed text and entities."""
import pytest
import torch
import transformers

from splitserve import LLM, SamplingParams
from splitserve.sampling_params import StructuredOutputsParams
from tests.multimodal_reference import random_image
from tests.zoo_reference import (assert_matches_reference, check_prefix_and_encoder_cache_hits,
                                 KOSMOS_QUERIES, hf_greedy, make_tiny_kosmos2_dir, run_abort_storm)

NEW_TOKENS = 8
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path, proc = make_tiny_kosmos2_dir(tmp_path_factory.mktemp("kosmos2") / "m", seed=8)
    hf = transformers.Kosmos2ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return path, proc, hf


def marker_reference_inputs(proc, text: str, imgs) -> dict:
    """Kosmos-2's own layout written out by hand: BOS + text; each <image> token becomes <image>,
    the 64 slot ids (unk + 1 ...), </image>; the slots are the image_embeds_position_mask."""
    tok = proc.tokenizer
    boi, eoi = tok.convert_tokens_to_ids("<image>"), tok.convert_tokens_to_ids("</image>")
    slots = list(range(tok.unk_token_id + 1, tok.unk_token_id + 1 + KOSMOS_QUERIES))
    ids, mask = [], []
    for t in tok.encode(tok.bos_token + text.strip(), add_special_tokens=False):
        run = [boi, *slots, eoi] if t == boi else [t]
        ids.extend(run)
        mask.extend([0, *[1] * KOSMOS_QUERIES, 0] if t == boi else [0])
    pixels = proc.image_processor(images=imgs, return_tensors="pt")["pixel_values"]
    return {"input_ids": torch.tensor([ids]), "image_embeds_position_mask": torch.tensor([mask]),
            "pixel_values": pixels}


def reference(setup, text: str, imgs):
    _, proc, hf = setup
    if not imgs:
        inputs = dict(proc(text=text, return_tensors="pt"))
        return (inputs["input_ids"][0].tolist(), *hf_greedy(hf.text_model, NEW_TOKENS, input_ids=inputs["input_ids"]))
    if "<image>" not in text:
        inputs = dict(proc(images=imgs, text=text, return_tensors="pt"))
    else:
        inputs = marker_reference_inputs(proc, text, imgs)
    return (inputs["input_ids"][0].tolist(), *hf_greedy(hf, NEW_TOKENS, **inputs))


PROMPTS = [
    ("<grounding> An image of", [(80, 60)]),            # no marker: Kosmos2Processor's layout
    ("The quick brown fox jumps over the lazy dog.", []),
    ("<grounding> Look at <image> and describe it:", [(50, 90)]),
    ("Compare <image> with <image> please.", [(64, 64), (120, 40)]),
]


def test_greedy_parity_mixed_batch(setup):
    path = setup[0]
    images = [[random_image(10 * i + j, size) for j, size in enumerate(sizes)] for i, (_, sizes) in enumerate(PROMPTS)]
    llm = LLM(path, num_blocks=128, block_size=16, max_num_batched_tokens=48)
    requests = [{"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text
                for (text, _), imgs in zip(PROMPTS, images)]
    outs = llm.generate(requests, PARAMS, use_tqdm=False)
    for (text, _), imgs, out in zip(PROMPTS, images, outs):
        assert_matches_reference(out, reference(setup, text, imgs), text)
        got = out.outputs[0]
        assert got.grounding == llm.engine.front.output_processor.text_postprocess(got.text)
    assert llm.engine.runner.mm.num_images_encoded == 4
    assert llm.engine.kv_manager.pool.is_whole() and llm.engine.runner.mm.cache.is_whole()


def test_prefix_and_encoder_cache_hits(setup):
    check_prefix_and_encoder_cache_hits(
        setup[0], '<grounding> Describe the picture in some detail:', 'Another question:', 512, PARAMS,
        lambda text, imgs: reference(setup, text, imgs)[1])


def test_abort_storm_leaves_pool_and_encoder_cache_whole(setup):
    def prompts(mm, rng):
        pool = [mm.process_image(random_image(300 + i, (30 + 11 * i, 45))) for i in range(4)]
        for i in range(18):
            if i % 3 == 1:
                yield mm.build_prompt(f"Plain text about robot number {i}.", [])
            elif i % 3 == 0:
                yield mm.build_prompt(f"<grounding> Question {i}:", rng.sample(pool, 1))
            else:
                yield mm.build_prompt(f"See <image> then <image> now {i}.", rng.sample(pool, 2))
    run_abort_storm(setup[0], prompts, num_blocks=40, budget=48)


GROUNDED = "<phrase> a snowman</phrase><object><patch_index_0044><patch_index_0863></object> warming himself"


def test_grounding_matches_transformers_post_processing(setup):
    """Location tokens forced into the output (a choice constraint) come back as transformers'
    post-processed text and entities; the raw text keeps the tokens."""
    path, proc, _ = setup
    llm = LLM(path, num_blocks=64, block_size=16)
    params = SamplingParams(max_tokens=40, temperature=0, structured_outputs=StructuredOutputsParams(choice=[GROUNDED]))
    out = llm.generate({"prompt": "<grounding> An image of", "multi_modal_data": {"image": random_image(5, (64, 64))}},
                       params, use_tqdm=False)[0].outputs[0]
    text = proc.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.text == text and "<patch_index_0044>" in text
    cleaned, entities = proc.post_process_generation(text)
    assert out.grounding["text"] == cleaned
    assert [(e["phrase"], tuple(e["span"]), [tuple(b) for b in e["boxes"]]) for e in out.grounding["entities"]] == \
        [(p, tuple(s), [tuple(b) for b in boxes]) for p, s, boxes in entities]
    assert entities and entities[0][0] == "a snowman"


def test_text_decoder_alone_matches_transformers(tmp_path):
    """The kosmos_2_text_model family as a text model (Kosmos2TextForCausalLM checkpoint): random
    prompts through the engine, greedy tokens and logprobs as transformers'."""
    import random

    from transformers import Kosmos2TextConfig
    from transformers.models.kosmos2.modeling_kosmos2 import Kosmos2TextForCausalLM

    from splitserve.loading.resolve import load_tokenizer
    from tests.hf_reference import assert_greedy_like_hf
    from tests.multimodal_reference import _randomize
    tok = load_tokenizer(None)
    config = Kosmos2TextConfig(vocab_size=len(tok), embed_dim=64, layers=2, ffn_dim=128, attention_heads=4,
                               max_position_embeddings=128, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                               scale_embedding=True)
    hf = Kosmos2TextForCausalLM(config).eval()
    _randomize(hf, 9)
    hf.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, len(tok)) for _ in range(rng.randrange(3, 60))] for _ in range(6)]
    llm = LLM(str(tmp_path), num_blocks=64, block_size=8, max_num_batched_tokens=96)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    assert_greedy_like_hf(hf, prompts, outs, 16)
    assert llm.engine.kv_manager.pool.is_whole()


def test_piecewise_graph_path_matches_transformers(setup):
    from tests.zoo_reference import generate_on_piecewise_path
    images = [[random_image(70 + j, size) for j, size in enumerate(sizes)] for _, sizes in PROMPTS[:2]]
    requests = [{"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text
                for (text, _), imgs in zip(PROMPTS[:2], images)]
    outs = generate_on_piecewise_path(setup[0], requests, PARAMS)
    for (text, _), imgs, out in zip(PROMPTS[:2], images, outs):
        assert out.outputs[0].token_ids == reference(setup, text, imgs)[1], text
