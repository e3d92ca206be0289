"""NeVA / Video NeVA from tiny `.nemo` archives written in NeMo's layout, against the independent
reference in tests/neva_reference.py (transformers' Nemotron + CLIP, PyAV frames): greedy tokens and
logprobs for one image, several images, images and text interleaved, videos (a file, bytes, decoded
frames), mixed batches, the chat template, encoder- and prefix-cache reuse, an abort storm, a
gzip'd tensor-parallel mcore archive with --num-frames, and the refusals."""
import io
import os
import random
import tarfile

import numpy as np
import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.multimodal.encoder_cache import EncoderCache
from splitserve.multimodal.media import MediaPolicy
from splitserve.multimodal.video import VideoRef
from tests.multimodal_reference import random_image
from tests.neva_reference import (EXTRA_IDS, NVGPT_SYSTEM, TOKENS_PER_IMAGE, ReferenceNeva, make_clip, make_decoder,
                                  make_projector, model_config, nemo_state_dict, read_video_frames, write_clip_dir,
                                  write_nemo, write_video)

NEW_TOKENS = 6
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
BLOCK = 8
FRAMES = 4
COLORS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (0, 255, 255), (255, 0, 255), (128, 128, 128),
          (20, 20, 20), (200, 100, 50)]


def neva_tokenizer():
    from splitserve.loading.resolve import load_tokenizer
    tok = load_tokenizer(None)
    tok.add_special_tokens({"additional_special_tokens": EXTRA_IDS})
    return tok


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("neva")
    tok = neva_tokenizer()  # before the cache moves: the default model's converted tokenizer is cached there
    old = os.environ.get("SPLITSERVE_CACHE_DIR")
    os.environ["SPLITSERVE_CACHE_DIR"] = str(root / "cache")  # where the .nemo archives are unpacked
    vocab = (len(tok) + 127) // 128 * 128  # NeMo pads the vocabulary (make_vocab_size_divisible_by)
    dec, clip, proj = make_decoder(vocab, 1), make_clip(2), make_projector(3)
    write_clip_dir(str(root / "clip-tiny"), clip, whole_clip=True)  # found relative to the .nemo file
    nemo = write_nemo(str(root / "neva.nemo"), model_config("clip-tiny", num_frames=FRAMES),
                      nemo_state_dict(dec, proj), tok)
    video = write_video(str(root / "clip.mp4"), COLORS)
    llm = LLM(nemo, num_blocks=512, block_size=BLOCK, max_num_batched_tokens=512, max_model_len=1024)
    yield llm, ReferenceNeva(dec, clip, proj, tok), tok, root, (dec, clip, proj), video
    if old is None:
        os.environ.pop("SPLITSERVE_CACHE_DIR", None)
    else:
        os.environ["SPLITSERVE_CACHE_DIR"] = old


def check(out, ref, segments):
    tokens, logprobs, ids = ref.greedy(segments, NEW_TOKENS)
    assert list(out.prompt_token_ids) == ids
    assert out.outputs[0].token_ids == tokens
    got = [d[t].logprob for d, t in zip(out.outputs[0].logprobs, tokens)]
    assert max(abs(a - b) for a, b in zip(got, logprobs)) < 2e-4


def run(llm, prompt):
    return llm.generate(prompt, PARAMS, use_tqdm=False)[0]


def test_one_image(setup):
    llm, ref, _, _, _, _ = setup
    img = random_image(1, (80, 64))
    out = run(llm, {"prompt": "<image>\nWhat is this?", "multi_modal_data": {"image": img}})
    ph = llm.engine.mm_processor.placeholder_id
    assert out.prompt_token_ids[:TOKENS_PER_IMAGE] == [ph] * TOKENS_PER_IMAGE
    check(out, ref, [("image", img), "\nWhat is this?"])


def test_several_images_interleaved_with_text(setup):
    llm, ref, _, _, _, _ = setup
    a, b = random_image(2, (64, 64)), random_image(3, (120, 50))
    out = run(llm, {"prompt": "Compare <image> with <image> and say which is brighter.",
                    "multi_modal_data": {"image": [a, b]}})
    check(out, ref, ["Compare ", ("image", a), " with ", ("image", b), " and say which is brighter."])


def test_video_file_bytes_and_frames(setup):
    """A path, its bytes and its decoded frames (a [T, H, W, 3] array) are one video: the same
    tokens, and the same frames as Video NeVA samples them (4 of 9, evenly)."""
    llm, ref, _, _, _, video = setup
    frames = read_video_frames(video, FRAMES)
    with open(video, "rb") as f:
        data = f.read()
    import av
    with av.open(video) as c:
        arr = np.stack([fr.to_ndarray(format="rgb24") for fr in c.decode(video=0)])
    for source in (video, data, arr, "file://" + video):
        out = run(llm, {"prompt": "<video>\nWhat happens?", "multi_modal_data": {"video": source}})
        check(out, ref, [("video", frames), "\nWhat happens?"])
        assert len(out.prompt_token_ids) == FRAMES * TOKENS_PER_IMAGE + len(ref.tok.encode("\nWhat happens?"))


def test_short_video_repeats_its_last_frame(setup):
    llm, ref, _, root, _, _ = setup
    path = write_video(str(root / "short.webm"), COLORS[:2], codec="libvpx", seed=4)
    frames = read_video_frames(path, FRAMES)
    out = run(llm, {"prompt": "Clip: <video> done", "multi_modal_data": {"video": path}})
    check(out, ref, ["Clip: ", ("video", frames), " done"])


def test_mixed_batch_of_images_videos_and_text(setup):
    llm, ref, tok, _, _, video = setup
    frames = read_video_frames(video, FRAMES)
    img = random_image(4, (70, 90))
    cases = [
        ({"prompt": "<video>\nDescribe the clip.", "multi_modal_data": {"video": video}},
         [("video", frames), "\nDescribe the clip."]),
        ({"prompt_token_ids": tok.encode("Plain text only, no media.", add_special_tokens=False)},
         ["Plain text only, no media."]),
        ({"prompt": "<image> then <video>", "multi_modal_data": {"image": img, "video": video}},
         [("image", img), " then ", ("video", frames)]),
        ({"prompt": "A picture: <image>", "multi_modal_data": {"image": img}}, ["A picture: ", ("image", img)]),
    ]
    outs = llm.generate([p for p, _ in cases], PARAMS, use_tqdm=False)
    for out, (_, segments) in zip(outs, cases):
        check(out, ref, segments)


def test_chat_uses_the_nvgpt_conversation_template(setup):
    """LLM.chat with image_url and video_url parts renders NeMo's nvgpt template (written out here by
    hand), with the media where the parts stood."""
    llm, ref, _, _, _, video = setup
    img = random_image(5, (60, 60))
    messages = [{"role": "user", "content": [{"type": "image", "image": img},
                                             {"type": "video_url", "video_url": {"url": "file://" + video}},
                                             {"type": "text", "text": "What do they show?"}]}]
    out = llm.chat(messages, PARAMS, use_tqdm=False)[0]
    check(out, ref, [f"<extra_id_0>System\n{NVGPT_SYSTEM}\n\n<extra_id_1>User\n", ("image", img), "\n",
                     ("video", read_video_frames(video, FRAMES)), "\nWhat do they show?\n<extra_id_1>Assistant\n"])


def test_encoder_and_prefix_cache_reuse(setup):
    llm, ref, _, _, _, video = setup
    mm = llm.engine.runner.mm
    frames = read_video_frames(video, FRAMES)
    text = "\nTell me a long story about this video, please."
    first = run(llm, {"prompt": "<video>" + text, "multi_modal_data": {"video": video}})
    encoded = mm.num_images_encoded
    with open(video, "rb") as f:  # the same video as bytes: the same content hash
        again = run(llm, {"prompt": "<video>" + text, "multi_modal_data": {"video": f.read()}})
    n = len(first.prompt_token_ids)
    assert again.num_cached_tokens == (n - 1) // BLOCK * BLOCK
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    other = run(llm, {"prompt": "<video> is something else", "multi_modal_data": {"video": video}})
    assert other.num_cached_tokens == FRAMES * TOKENS_PER_IMAGE // BLOCK * BLOCK  # the video's blocks
    assert mm.num_images_encoded == encoded
    check(other, ref, [("video", frames), " is something else"])
    # a different video (its frames reversed) shares no blocks and is encoded anew
    rev = run(llm, {"prompt": "<video> is something else", "multi_modal_data": {"video": frames[::-1]}})
    assert rev.num_cached_tokens == 0 and mm.num_images_encoded == encoded + 1
    check(rev, ref, [("video", read_video_frames(video, FRAMES)[::-1]), " is something else"])
    assert llm.engine.kv_manager.pool.is_whole() and mm.cache.is_whole()


def test_abort_storm_leaves_pool_and_encoder_cache_whole(setup):
    llm, _, tok, root, _, video = setup
    engine = llm.engine
    mm = engine.runner.mm
    saved, mm.cache = mm.cache, EncoderCache(capacity_tokens=2 * FRAMES * TOKENS_PER_IMAGE)
    mp = engine.mm_processor
    try:
        rng = random.Random(7)
        videos = [video, write_video(str(root / "storm.mp4"), COLORS[3:], seed=9)]
        images = [random_image(60 + i, (40 + 20 * i, 90 - 10 * i)) for i in range(3)]
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        ids = []
        for i in range(20):
            text = " ".join(rng.choice("red green blue cat dog tree".split()) for _ in range(rng.randrange(1, 8)))
            kind = i % 3
            if kind == 0:
                p = tok.encode(text, add_special_tokens=False)
            elif kind == 1:
                p = mp.build_prompt("<image> " + text, mp.load_and_process([rng.choice(images)], MediaPolicy.offline()))
            else:
                p = mp.build_prompt("<video> " + text, mp.load_and_process([VideoRef(rng.choice(videos))],
                                                                           MediaPolicy.offline()))
            ids.append(engine.add_request(f"n{i}", p, params, stream=False))
        doomed = set(rng.sample(ids, 9))
        while engine.has_unfinished_requests():
            engine.step()
            live = sorted(d for d in doomed if d in engine.states)
            if live and rng.random() < 0.5:
                engine.abort_request(rng.choice(live))
        assert engine.kv_manager.pool.is_whole()
        assert mm.cache.num_pinned() == 0 and mm.cache.is_whole()
        assert not engine.scheduler.requests and not engine.states
    finally:
        mm.cache = saved


def test_refusals(setup):
    llm, _, tok, root, _, video = setup
    mp = llm.engine.mm_processor
    ph = mp.placeholder_id
    with pytest.raises(ValueError, match="no image or video was given"):
        run(llm, {"prompt_token_ids": tok.encode("look:", add_special_tokens=False) + [ph]})
    with pytest.raises(ValueError, match="no image or video was given"):
        run(llm, tok.encode("look:", add_special_tokens=False) + [ph, ph])
    with pytest.raises(ValueError, match="could not be decoded"):
        run(llm, {"prompt": "<video>", "multi_modal_data": {"video": b"definitely not a video"}})
    with pytest.raises(ValueError, match="2 video placeholder"):
        run(llm, {"prompt": "<video> and <video>", "multi_modal_data": {"video": video}})
    old = mp.num_frames
    mp.num_frames = 80  # 80 x 16 tokens > max_model_len 1024
    try:
        with pytest.raises(ValueError, match="lower --num-frames"):
            run(llm, {"prompt": "<video>", "multi_modal_data": {"video": video}})
    finally:
        mp.num_frames = old
    assert llm.engine.kv_manager.pool.is_whole()


def test_token_id_prompt_marks_media_by_id(setup):
    """The benchmark contract: the placeholder id marks an image; -201 marks a video."""
    llm, ref, tok, _, _, video = setup
    img = random_image(9, (64, 80))
    mp = llm.engine.mm_processor
    ids = [mp.placeholder_id] + tok.encode(" and ", add_special_tokens=False) + [mp.video_marker_id]
    out = run(llm, {"prompt_token_ids": ids, "multi_modal_data": {"image": img, "video": video}})
    check(out, ref, [("image", img), " and ", ("video", read_video_frames(video, FRAMES))])


def test_gzipped_tensor_parallel_mcore_archive_with_num_frames(setup):
    """mp_rank_00/01 shards (query groups split across ranks) of mcore-named tensors in a gzip'd
    tar, the vision tower's weights inside the checkpoint and its directory given absolute; the
    engine's --num-frames overrides the config's; media runs split across prefill chunks."""
    _, _, tok, root, (dec, clip, proj), video = setup
    tower = write_clip_dir(str(root / "clip-abs"), clip)
    sd = nemo_state_dict(dec, proj, mcore=True)
    prefix = "model.embedding.word_embeddings.vision_encoder."
    sd.update({prefix + k: v.clone() for k, v in clip.state_dict().items()})
    os.remove(os.path.join(tower, "model.safetensors"))  # the checkpoint's tower weights must be used
    nemo = write_nemo(str(root / "neva-tp2.nemo"), model_config(tower, num_frames=8, mcore=True, tp=2), sd, tok,
                      tp=2, compress=True)
    # a 12-token step budget cuts the video's 32-token run (and the image's 16) across prefill chunks
    llm = LLM(nemo, num_blocks=128, block_size=BLOCK, max_model_len=1024, num_frames=2, max_num_batched_tokens=12)
    ref = ReferenceNeva(dec, clip, proj, tok)
    out = run(llm, {"prompt": "<video>\nWhat happens?", "multi_modal_data": {"video": video}})
    check(out, ref, [("video", read_video_frames(video, 2)), "\nWhat happens?"])
    img = random_image(11, (50, 70))
    outs = llm.generate([{"prompt": "Look: <image> and <video>.", "multi_modal_data": {"image": img, "video": video}},
                         {"prompt": "<video>", "multi_modal_data": {"video": video}}], PARAMS, use_tqdm=False)
    check(outs[0], ref, ["Look: ", ("image", img), " and ", ("video", read_video_frames(video, 2)), "."])
    check(outs[1], ref, [("video", read_video_frames(video, 2))])
    assert llm.engine.kv_manager.pool.is_whole() and llm.engine.runner.mm.cache.is_whole()


def test_archive_errors(tmp_path, monkeypatch):
    from splitserve.loading.neva_nemo import unpack_nemo as unpack
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "bad.nemo"
    bad.write_bytes(b"not a tar at all")
    with pytest.raises(ValueError, match="not a readable .nemo archive"):
        unpack(str(bad))
    dist = tmp_path / "dist.nemo"
    with tarfile.open(dist, "w") as tar:
        for name, data in (("./model_config.yaml", b"num_layers: 2\n"),
                           ("./model_weights/metadata.json", b"{}"), ("./model_weights/__0_0.distcp", b"x")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ValueError, match="distributed checkpoint"):
        unpack(str(dist))


def test_missing_vision_tower_is_a_clear_error(setup):
    _, _, tok, root, (dec, _, proj), _ = setup
    nemo = write_nemo(str(root / "no-tower.nemo"), model_config("nowhere/clip-missing"), nemo_state_dict(dec, proj), tok)
    with pytest.raises(ValueError, match="vision tower .* was not found"):
        LLM(nemo, num_blocks=32, block_size=BLOCK, max_model_len=256)


def test_video_for_a_model_without_video():
    """A processor whose model names no video marker refuses video parts and video data."""
    from splitserve.multimodal.media import MediaError
    from splitserve.multimodal.processor import MultiModalProcessor
    mp = MultiModalProcessor.__new__(MultiModalProcessor)
    mp.model, mp.video_marker_id, mp.num_frames = torch.nn.Module(), None, None
    with pytest.raises(MediaError, match="does not accept videos"):
        mp.load_media(VideoRef(b"x"), MediaPolicy.offline())


def test_sentencepiece_tokenizer_in_the_archive(tmp_path, monkeypatch):
    """An archive whose tokenizer is a sentencepiece model (`nemo:<file>.model`): the HF tokenizer
    made from it encodes as sentencepiece itself does (NeMo's text_to_ids), specials included. (A
    model with sentencepiece's dummy prefix differs at the start of a text: see DESIGN.md.)"""
    spm = pytest.importorskip("sentencepiece")
    pytest.importorskip("google.protobuf")
    from splitserve.loading.neva_nemo import unpack_nemo as unpack
    from splitserve.loading.resolve import load_tokenizer
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path / "cache"))
    text = [f"the quick brown fox jumps over the lazy dog {i}" for i in range(100)] + \
        ["A chat between a curious user and an assistant.\nSystem User Assistant"] * 5
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text), model_writer=model, vocab_size=400, model_type="bpe", user_defined_symbols=EXTRA_IDS,
        byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2, normalization_rule_name="identity",
        add_dummy_prefix=False, remove_extra_whitespaces=False)
    cfg = model_config("absent-tower")
    cfg["tokenizer"] = {"library": "sentencepiece", "model": "nemo:0a1b2c_tokenizer.model", "type": None}
    weights = io.BytesIO()
    torch.save({"model.language_model.embedding.word_embeddings.weight": torch.zeros(512, 4)}, weights)
    path = tmp_path / "spm.nemo"
    with tarfile.open(path, "w") as tar:
        for name, data in (("./model_config.yaml", __import__("yaml").safe_dump(cfg).encode()),
                           ("./model_weights.ckpt", weights.getvalue()), ("./0a1b2c_tokenizer.model", model.getvalue())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    tok = load_tokenizer(unpack(str(path)))
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    for s in ["<extra_id_0>System\nhello fox<extra_id_3>", "A chat between\n\n<extra_id_1>User\nthe dog 12 ü",
              " leading  spaces  x\n", "<extra_id_1>Assistant\n", "\nWhat is this?"]:
        assert tok.encode(s, add_special_tokens=False) == sp.encode(s), s
    assert tok.encode("the dog") == sp.encode("the dog")  # no BOS, as NeMo's prompts
    assert tok.chat_template is not None


def test_pad_aspect_ratio_pads_to_a_square_first():
    """image_aspect_ratio 'pad': the model's preprocessing equals NeMo's expand2square + the CLIP
    processor (written independently in the reference)."""
    from types import SimpleNamespace

    from splitserve.models.neva.model import NevaForCausalLM
    from tests.neva_reference import clip_image_processor, expand_to_square
    proc = clip_image_processor()
    for size in ((90, 40), (40, 90), (56, 56)):
        img = random_image(sum(size), size)
        model = SimpleNamespace(pad_to_square=True, tokens_per_image=TOKENS_PER_IMAGE)
        pixels, _, n = NevaForCausalLM.preprocess_image(model, proc, img)
        want = proc(images=[expand_to_square(img, proc.image_mean)], return_tensors="pt")["pixel_values"]
        assert n == TOKENS_PER_IMAGE and torch.equal(pixels, want)
        plain, _, _ = NevaForCausalLM.preprocess_image(SimpleNamespace(pad_to_square=False, tokens_per_image=16), proc, img)
        assert torch.equal(plain, proc(images=[img], return_tensors="pt")["pixel_values"])
