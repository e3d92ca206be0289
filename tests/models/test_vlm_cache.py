"""Encoder-output cache and image-aware prefix caching, on a tiny LLaVA (CLIP tower).

References are independent: HF transformers greedy runs for correctness, and for reuse the exact
block arithmetic (which blocks lie wholly before the image, which the prefix cache may serve).
"""
from types import SimpleNamespace

import pytest
import torch
import transformers

from splitserve import LLM, SamplingParams
from splitserve.multimodal.encoder_cache import EncoderCache
from tests.multimodal_reference import hf_greedy_mm, hf_processor, make_tiny_llava_dir, mm_tokenizer, random_image

BLOCK = 16
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = mm_tokenizer()
    path = make_tiny_llava_dir(tmp_path_factory.mktemp("llava") / "m", tok, "clip", False, seed=3)
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, num_blocks=64, block_size=BLOCK, max_num_batched_tokens=512)
    return llm, hf, hf_processor(path, tok, "clip", False)


def run(llm, text, img):
    return llm.generate({"prompt": text, "multi_modal_data": {"image": [img]}}, PARAMS, use_tqdm=False)[0]


def reference(hf, processor, text, img) -> list[int]:
    return hf_greedy_mm(hf, dict(processor(text=text, images=[img], return_tensors="pt")), PARAMS.max_tokens)[0]


def test_repeated_image_hits_the_encoder_cache(setup):
    llm, hf, processor = setup
    mm = llm.engine.runner.mm
    img = random_image(7, (70, 50))
    # Different text before the image: no KV block can be shared, so the image must be embedded again.
    first = run(llm, "Alpha beta gamma delta. <image> What is it?", img)
    encoded, hits = mm.num_images_encoded, mm.cache.hits
    second = run(llm, "Some other words first! <image> What is it?", img)
    assert mm.num_images_encoded == encoded, "the repeated image went through the vision tower again"
    assert mm.cache.hits > hits
    assert first.outputs[0].token_ids == reference(hf, processor, "Alpha beta gamma delta. <image> What is it?", img)
    assert second.outputs[0].token_ids == reference(hf, processor, "Some other words first! <image> What is it?", img)
    assert llm.engine.kv_manager.pool.is_whole() and mm.cache.is_whole()


def test_prefix_cache_reuses_blocks_only_for_the_same_image(setup):
    llm, hf, processor = setup
    prefix = "You are a careful assistant who looks at pictures and answers briefly. " * 2
    text = prefix + "<image> Now describe the picture in detail, please."
    img_a, img_b = random_image(21, (64, 64)), random_image(22, (64, 64))
    base = run(llm, text, img_a)
    image_offset = base.prompt_token_ids.index(llm.engine.mm_processor.placeholder_id)
    n = len(base.prompt_token_ids)
    assert base.num_cached_tokens <= image_offset // BLOCK * BLOCK  # nothing image-related cached yet

    same = run(llm, text, img_a)
    assert same.num_cached_tokens == (n - 1) // BLOCK * BLOCK, "same image + prefix should reuse every full block"
    assert same.outputs[0].token_ids == base.outputs[0].token_ids

    other = run(llm, text, img_b)
    assert other.num_cached_tokens == image_offset // BLOCK * BLOCK, "blocks holding image A were reused for image B"
    assert other.outputs[0].token_ids == reference(hf, processor, text, img_b)
    assert llm.engine.kv_manager.pool.is_whole() and llm.engine.runner.mm.cache.is_whole()


def _request(rid: str, computed: int):
    """A running request as the worker's persistent batch shows it to the cache."""
    return SimpleNamespace(req_id=rid, is_active=True, num_computed_tokens=computed)


def test_encoder_cache_is_lru_bounded_and_keeps_what_running_requests_need():
    cache = EncoderCache(capacity_tokens=8)
    feats = {k: torch.zeros(4, 2) for k in "abcd"}
    user = _request("r", computed=10)
    cache.pin("a", user, end=20)          # r is mid-prefill inside image a's run
    cache.put("a", feats["a"])
    cache.put("b", feats["b"])
    cache.get("b")
    cache.put("c", feats["c"])            # over the bound: a is least recent but needed, so b goes
    assert "a" in cache and "c" in cache
    assert "b" not in cache and cache.num_tokens == 8
    user.num_computed_tokens = 20         # r moved past image a
    cache.put("d", feats["d"])
    assert "a" not in cache and {"c", "d"} <= {k for k in "abcd" if k in cache}
    assert cache.is_whole()

    finished = _request("f", computed=0)
    cache.pin("c", finished, end=50)
    finished.is_active = False            # an aborted request (gone from the batch) needs nothing
    assert cache.num_pinned() == 0 and cache.is_whole()


def test_encoder_cache_keeps_reserved_entries_until_pinned_or_released():
    # Features encoded ahead of admission are reserved: counted against the room, never evicted,
    # until their request pins them (admitted) or the reservation goes (it ended while waiting).
    cache = EncoderCache(capacity_tokens=8)
    cache.put("a", torch.zeros(4, 2), reserve=True)
    assert cache.room() == 4
    cache.put("b", torch.zeros(4, 2))
    cache.put("c", torch.zeros(4, 2))     # over the bound: b goes, a is reserved
    assert "a" in cache and "b" not in cache and cache.room() == 4
    assert not cache.is_whole()           # a reservation is outstanding
    user = _request("r", computed=0)
    cache.pin("a", user, end=4)           # admitted: the pin takes over from the reservation
    user.num_computed_tokens = 4
    cache.put("d", torch.zeros(4, 2), reserve=True)
    cache.unreserve("d")                  # its request was aborted while waiting
    assert cache.room() == 8 and cache.is_whole()


def test_images_of_waiting_requests_are_encoded_ahead(setup):
    """Two sequences at a time for six image requests: the images of waiting requests are encoded
    before their admission (in batches, on CPU synchronously), their steps find them in the cache,
    the outputs match transformers and nothing stays reserved."""
    _, hf, processor = setup
    llm = LLM(hf.config._name_or_path, num_blocks=64, block_size=BLOCK, max_num_batched_tokens=512, max_num_seqs=2)
    mm = llm.engine.runner.mm
    texts = [f"Picture {i}: <image> what is it?" for i in range(6)]
    imgs = [random_image(40 + i, (50 + 7 * i, 60)) for i in range(6)]
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": [i]}} for t, i in zip(texts, imgs)],
                        PARAMS, use_tqdm=False)
    assert mm.num_images_prefetched == 4 and mm.num_images_encoded == 6  # all but the first two admitted
    for out, text, img in zip(outs, texts, imgs):
        assert out.outputs[0].token_ids == reference(hf, processor, text, img)
    assert not mm.pending and not mm.announced and mm.cache.is_whole()
    assert llm.engine.kv_manager.pool.is_whole()


def test_encoder_cache_never_evicts_a_needed_image_in_chunked_prefill(setup):
    """A one-token cache and a 24-token step budget: every image run spans steps and overflows the
    cache, yet each image is encoded once per request and the outputs match transformers."""
    _, hf, processor = setup
    llm = LLM(hf.config._name_or_path, num_blocks=64, block_size=BLOCK, max_num_batched_tokens=24)
    runner = llm.engine.runner
    runner.mm.cache = EncoderCache(capacity_tokens=1)
    texts = ["Look: <image> and tell.", "A picture <image> of what?"]
    imgs = [random_image(31, (60, 80)), random_image(32, (90, 40))]
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": [i]}} for t, i in zip(texts, imgs)],
                        PARAMS, use_tqdm=False)
    assert runner.mm.num_images_encoded == 2
    for t, i, out in zip(texts, imgs, outs):
        assert out.outputs[0].token_ids == reference(hf, processor, t, i)
    assert runner.mm.cache.is_whole() and len(runner.mm.cache) <= 1
    assert llm.engine.kv_manager.pool.is_whole()


def test_offline_chat_takes_pil_images_paths_and_data_urls(setup, tmp_path):
    """LLM.chat with the same image given three ways: one answer, HF's; the image is encoded once."""
    import base64
    import io
    llm, hf, processor = setup
    img = random_image(51, (72, 48))
    img.save(tmp_path / "pic.png")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    encoded = llm.engine.runner.mm.num_images_encoded
    outs = [llm.chat([{"role": "user", "content": [{"type": "image", "image": source},
                                                   {"type": "text", "text": "What is this?"}]}],
                     PARAMS, use_tqdm=False)[0] for source in (img, str(tmp_path / "pic.png"), url)]
    tok = processor.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "<image>\nWhat is this?"}],
                                   add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=[img], return_tensors="pt", add_special_tokens=False)
    want = hf_greedy_mm(hf, dict(inputs), PARAMS.max_tokens)[0]
    assert [o.outputs[0].token_ids for o in outs] == [want] * 3
    assert llm.engine.runner.mm.num_images_encoded == encoded + 1
    with pytest.raises(ValueError, match="could not be decoded"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
                 PARAMS, use_tqdm=False)
    assert llm.engine.kv_manager.pool.is_whole() and llm.engine.runner.mm.cache.is_whole()


def test_placeholder_id_without_an_image_and_a_video_are_refused(setup):
    """A token-id prompt holding LLaVA's image token but no image would read that token's own
    embedding where features belong: refused, as is a video for a model that takes none."""
    llm, _, _ = setup
    tok = llm.tokenizer
    ph = llm.engine.mm_processor.placeholder_id
    with pytest.raises(ValueError, match="no image or video was given"):
        llm.generate({"prompt_token_ids": tok.encode("Look at", add_special_tokens=False) + [ph]}, PARAMS, use_tqdm=False)
    with pytest.raises(ValueError, match="does not accept videos"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"video": b"\x00" * 16}}, PARAMS, use_tqdm=False)
    with pytest.raises(ValueError, match="does not accept videos"):
        llm.chat([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}],
                 PARAMS, use_tqdm=False)
    ok = llm.generate({"prompt_token_ids": tok.encode("Look at", add_special_tokens=False)}, PARAMS, use_tqdm=False)[0]
    assert len(ok.outputs[0].token_ids) == PARAMS.max_tokens
    assert llm.engine.kv_manager.pool.is_whole()


def test_images_arriving_while_others_decode_are_encoded_beside_a_step(setup):
    """Requests with images that arrive while another decodes wait one step for their towers, which
    run beside that step (on CPU synchronously, after its forward): no image is encoded inside the
    step that admits its request, the burst is chunked by the encoder budget, and the greedy tokens
    are transformers' (the same as encoding every image in its admitting step, budget 0)."""
    from splitserve.multimodal.processor import offline_prompt
    _, hf, processor = setup
    path = hf.config._name_or_path
    texts = [f"Request {i}: <image> what is shown?" for i in range(5)]
    imgs = [random_image(60 + i, (48 + 9 * i, 64)) for i in range(5)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    got = {}
    for budget in (0, 2 * 16):  # tiny LLaVA: 16 image tokens per image, two images per step
        llm = LLM(path, num_blocks=128, block_size=BLOCK, max_num_batched_tokens=4096, mm_encoder_budget=budget)
        engine, mm = llm.engine, llm.engine.runner.mm
        engine.add_request("r0", offline_prompt(engine, {"prompt": texts[0], "multi_modal_data": {"image": imgs[0]}}),
                           params, stream=False)
        outs, steps = {}, 0
        while engine.has_unfinished_requests():
            if steps == 2:  # r0 decodes: a burst of four arrives
                for i in range(1, 5):
                    engine.add_request(f"r{i}", offline_prompt(engine, {"prompt": texts[i],
                                                                        "multi_modal_data": {"image": imgs[i]}}),
                                       params, stream=False)
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = list(o.outputs[0].token_ids)
            steps += 1
        got[budget] = [outs[f"r{i}"] for i in range(5)]
        assert mm.num_images_encoded == 5
        assert mm.num_images_prefetched == (0 if budget == 0 else 4)
        assert engine.kv_manager.pool.is_whole() and mm.cache.is_whole() and not mm.pending
    assert got[0] == got[2 * 16]
    for toks, text, img in zip(got[0], texts, imgs):
        assert toks == hf_greedy_mm(hf, dict(processor(text=text, images=[img], return_tensors="pt")), 10)[0]
