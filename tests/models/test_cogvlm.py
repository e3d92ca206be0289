"""CogVLM (`CogVLMForCausalLM`) from a tiny checkpoint with the real tensor names, against the
plain-torch reference of the published code in tests/cogvlm_reference.py (its language path checked
against transformers' Llama here): greedy tokens and logprobs with the visual expert and CogVLM's
3-position images, image runs split across prefill chunks, mixed batches with text-only requests,
encoder- and prefix-cache reuse, an abort storm, refusals, and the 17B config's parameter count."""
import os
import random

import pytest
import torch
import transformers

from splitserve import LLM, SamplingParams
from splitserve.multimodal.encoder_cache import EncoderCache
from tests.cogvlm_reference import ReferenceCogVLM, make_tiny_cogvlm_dir
from tests.multimodal_reference import mm_tokenizer, random_image

NEW_TOKENS = 8
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
BLOCK = 8
IMAGE_TOKENS = 4 * 4 + 2  # 56 px / 14 = 4x4 patches, boi, eoi


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = mm_tokenizer()
    path = make_tiny_cogvlm_dir(tmp_path_factory.mktemp("cogvlm") / "cogvlm-tiny", tok, seed=3)
    llm = LLM(path, num_blocks=256, block_size=BLOCK, max_num_batched_tokens=512, max_model_len=1024)
    return llm, ReferenceCogVLM(path), tok, path


def check(out, ref, tok, text, img):
    tokens, logprobs, ref_ids = ref.greedy(tok, text, img, NEW_TOKENS)
    got_ids = list(out.prompt_token_ids)
    assert len(got_ids) == len(ref_ids) and got_ids[0] == ref_ids[0]
    n = IMAGE_TOKENS if img is not None else 0
    assert got_ids[1 + n:] == ref_ids[1 + n:]
    assert out.outputs[0].token_ids == tokens
    got = [d[t].logprob for d, t in zip(out.outputs[0].logprobs, tokens)]
    assert max(abs(a - b) for a, b in zip(got, logprobs)) < 2e-4


def prompt(tok, text, img):
    if img is None:
        return {"prompt_token_ids": [tok.bos_token_id] + tok.encode(text, add_special_tokens=False)}
    return {"prompt": "<image>" + text, "multi_modal_data": {"image": img}}


def test_reference_language_path_is_llama(setup):
    """The reference with no image tokens is transformers' Llama on the language expert's weights."""
    _, ref, tok, path = setup
    cfg = ref.cfg
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=cfg["vocab_size"], rms_norm_eps=1e-5, max_position_embeddings=2048, tie_word_embeddings=False)).eval()
    w = ref.w
    state = {"model.embed_tokens.weight": w["model.embed_tokens.weight"], "model.norm.weight": w["model.norm.weight"],
             "lm_head.weight": w["lm_head.weight"]}
    for i in range(2):
        b = f"model.layers.{i}."
        q, k, v = w[b + "self_attn.language_expert_query_key_value.weight"].split(64)
        state.update({b + "self_attn.q_proj.weight": q, b + "self_attn.k_proj.weight": k, b + "self_attn.v_proj.weight": v,
                      b + "self_attn.o_proj.weight": w[b + "self_attn.language_expert_dense.weight"],
                      b + "input_layernorm.weight": w[b + "input_layernorm.weight"],
                      b + "post_attention_layernorm.weight": w[b + "post_attention_layernorm.weight"],
                      **{f"{b}mlp.{p}.weight": w[f"{b}mlp.language_mlp.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj")}})
    llama.load_state_dict(state)
    ids = torch.tensor(tok.encode("The quick brown fox jumps over the lazy dog"))
    with torch.inference_mode():
        want = llama(ids[None]).logits[0]
    got = ref.logits(w["model.embed_tokens.weight"][ids], torch.zeros_like(ids), torch.arange(len(ids)))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_one_image(setup):
    llm, ref, tok, _ = setup
    img = random_image(1, (90, 60))
    text = "Question: what is in the picture? Answer:"
    out = llm.generate(prompt(tok, text, img), PARAMS, use_tqdm=False)[0]
    assert out.prompt_token_ids[1:1 + IMAGE_TOKENS] == [llm.engine.mm_processor.placeholder_id] * IMAGE_TOKENS
    check(out, ref, tok, text, img)


def test_mixed_batch_with_text_only_requests(setup):
    llm, ref, tok, _ = setup
    cases = [("Describe it.", random_image(2, (64, 64))), ("Question: a long question about many things? Answer:", None),
             (" [INST] What colour dominates? [/INST] ", random_image(3, (120, 50))), ("Hello there", None)]
    outs = llm.generate([prompt(tok, t, i) for t, i in cases], PARAMS, use_tqdm=False)
    for out, (text, img) in zip(outs, cases):
        check(out, ref, tok, text, img)


def test_image_split_across_prefill_chunks(setup):
    """A step budget of 7 tokens cuts the BOS + 18 image tokens into chunks: the expert mask and
    the RoPE shift are per token, so chunking changes nothing."""
    _, ref, tok, path = setup
    llm = LLM(path, num_blocks=64, block_size=BLOCK, max_num_batched_tokens=7, max_model_len=1024,
              enable_prefix_caching=False)
    cases = [("What is this?", random_image(4, (70, 90))), ("And this one, please?", random_image(5, (90, 70)))]
    outs = llm.generate([prompt(tok, t, i) for t, i in cases], PARAMS, use_tqdm=False)
    for out, (text, img) in zip(outs, cases):
        check(out, ref, tok, text, img)
    assert llm.engine.kv_manager.pool.is_whole() and llm.engine.runner.mm.cache.is_whole()


def test_encoder_and_prefix_cache_reuse(setup):
    llm, ref, tok, _ = setup
    mm = llm.engine.runner.mm
    img = random_image(6, (80, 80))
    first = llm.generate(prompt(tok, "Tell me a long story about the picture please.", img), PARAMS, use_tqdm=False)[0]
    encoded = mm.num_images_encoded
    again = llm.generate(prompt(tok, "Tell me a long story about the picture please.", img), PARAMS, use_tqdm=False)[0]
    n = len(first.prompt_token_ids)
    assert again.num_cached_tokens == (n - 1) // BLOCK * BLOCK
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    other_text = "Something else entirely."
    other = llm.generate(prompt(tok, other_text, img), PARAMS, use_tqdm=False)[0]
    assert other.num_cached_tokens == (1 + IMAGE_TOKENS) // BLOCK * BLOCK  # the blocks of BOS + image
    assert mm.num_images_encoded == encoded
    check(other, ref, tok, other_text, img)
    assert llm.engine.kv_manager.pool.is_whole() and mm.cache.is_whole()


def test_refusals(setup):
    llm, _, tok, _ = setup
    imgs = [random_image(7, (60, 60)), random_image(8, (60, 60))]
    with pytest.raises(ValueError, match="one image"):
        llm.generate({"prompt": "<image> and <image>", "multi_modal_data": {"image": imgs}}, PARAMS, use_tqdm=False)
    ph = llm.engine.mm_processor.placeholder_id
    with pytest.raises(ValueError, match="first"):
        llm.generate({"prompt_token_ids": tok.encode("some words first") + [ph], "multi_modal_data": {"image": imgs[0]}},
                     PARAMS, use_tqdm=False)
    assert llm.engine.kv_manager.pool.is_whole()


def test_abort_storm_leaves_pool_and_encoder_cache_whole(setup):
    llm, _, tok, _ = setup
    engine = llm.engine
    mm = engine.runner.mm
    saved, mm.cache = mm.cache, EncoderCache(capacity_tokens=3 * IMAGE_TOKENS)
    try:
        rng = random.Random(5)
        images = [random_image(50 + i, (40 + 20 * i, 90 - 10 * i)) for i in range(5)]
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        ids = []
        for i in range(24):
            text = " ".join(rng.choice("red green blue cat dog tree".split()) for _ in range(rng.randrange(1, 9)))
            p = prompt(tok, text, rng.choice(images) if i % 3 else None)
            if "prompt" in p:
                mp = engine.mm_processor
                p = mp.build_prompt(p["prompt"], mp.load_and_process([p["multi_modal_data"]["image"]], _offline()))
            else:
                p = p["prompt_token_ids"]
            ids.append(engine.add_request(f"c{i}", p, params, stream=False))
        doomed = set(rng.sample(ids, 10))
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


def _offline():
    from splitserve.multimodal.media import MediaPolicy
    return MediaPolicy.offline()


def test_real_size_config_has_cogvlm_17b_parameter_count():
    """benchmarks/configs/cogvlm-17b on the meta device: Vicuna-7B (6.74B) + the visual expert
    (QKV with bias, dense, MLP per layer: 6.44B) + EVA2-CLIP-E (4.28B) + the GLU projector (0.14B)
    = 17.6B, the "17B" of the name (10B vision + 7B language in the paper's split)."""
    from splitserve.models.cogvlm.config import load_cogvlm_config
    from splitserve.models.cogvlm.model import CogVLMForCausalLM
    root = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "configs", "cogvlm-17b")
    config = load_cogvlm_config(root)
    with torch.device("meta"):
        model = CogVLMForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    H, I, L, V = 4096, 11008, 32, 32000
    llama = 2 * V * H + L * (4 * H * H + 3 * H * I + 2 * H) + H
    expert = L * (3 * H * H + 3 * H + H * H + 3 * H * I)
    d, vi, vl = 1792, 15360, 63
    eva = d * 3 * 14 * 14 + d + d + 1226 * d + vl * (3 * d * d + 3 * d + d * d + d + 2 * d * vi + vi + d + 4 * d)
    glu = d * H + 2 * H + 3 * H * I + 2 * H
    assert total == llama + expert + eva + glu
    assert abs(total / 1e9 - 17.64) < 0.01


def test_token_id_prompt_with_the_placeholder_id(setup):
    """The benchmark contract: one placeholder id in a token-id prompt stands for one image."""
    llm, ref, tok, _ = setup
    img = random_image(9, (64, 80))
    text = "Question: what is it? Answer:"
    ids = [tok.bos_token_id, llm.engine.mm_processor.placeholder_id] + tok.encode(text, add_special_tokens=False)
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": img}}, PARAMS, use_tqdm=False)[0]
    check(out, ref, tok, text, img)


@pytest.mark.parametrize("name, cls", [("cogvlm-17b", "CogVLMForCausalLM"), ("phi-3-vision", "Phi3VForCausalLM")])
def test_tiny_overrides_build_a_small_model_with_the_real_geometry(tmp_path, name, cls):
    """config.json merged with tiny_overrides.json (nested dicts merged) loads through the engine's
    config reader and encodes an image into the real number of tokens."""
    import json
    import shutil
    from splitserve.models.loader import load_hf_config
    from splitserve.models.registry import get_model_class
    from splitserve.loading.resolve import resolve_model
    from splitserve.protocol.mm_inputs import ImageItem
    root = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "configs", name)

    def merge(a, b):
        return {**a, **{k: merge(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
                        for k, v in b.items()}}
    with open(os.path.join(root, "config.json")) as f, open(os.path.join(root, "tiny_overrides.json")) as g:
        cfg = merge(json.load(f), json.load(g))
    for file in os.listdir(root):
        if file not in ("config.json", "tiny_overrides.json"):
            shutil.copy(os.path.join(root, file), tmp_path / file)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    config = load_hf_config(resolve_model(str(tmp_path)))
    arch, model_cls = get_model_class(config.architectures)
    assert arch == cls
    model = model_cls(config).eval()
    assert sum(p.numel() for p in model.parameters()) < 60e6
    proc = model.load_image_processor(str(tmp_path))
    out = proc(images=[random_image(1, (336, 336))])
    pixels = out["pixel_values"][0] if out["pixel_values"].dim() == 5 else out["pixel_values"]
    size = tuple(out["image_sizes"][0].tolist()) if "image_sizes" in out else (336, 336)
    n = model.num_image_tokens(pixels.shape[0], size)
    with torch.inference_mode():
        feats = model.encode_images([ImageItem("h", pixels, size, n)])[0]
    assert feats.shape == (n, cfg["hidden_size"])
    # Phi-3-vision with num_crops 16 scales a square 336 px image up to 4 x 4 crops: 2509 tokens
    assert n == {"cogvlm-17b": 35 * 35 + 2, "phi-3-vision": 4 * 12 * (4 * 12 + 1) + 1 + 12 * 13}[name]


def test_visual_expert_runs_only_on_image_rows(setup):
    """The visual expert as a two-expert MoE routed by token type: a text-only request never runs
    its weights (every step a plain Llama step, no route), and a request with an image runs them on
    its image rows alone (boi + patches; eoi and the text take the language weights)."""
    llm, ref, tok, _ = setup
    layer = llm.engine.runner.model.language_model.layers[0]
    rows = {"vision": 0, "language": 0}

    def counter(key):
        def hook(module, args, out):
            rows[key] += args[0].shape[0]
        return hook

    handles = [layer.vision_qkv.register_forward_hook(counter("vision")),
               layer.self_attn.qkv_proj.register_forward_hook(counter("language"))]
    try:
        text = "Question: a question without any picture? Answer:"
        out = llm.generate(prompt(tok, text, None), PARAMS, use_tqdm=False)[0]
        check(out, ref, tok, text, None)
        assert rows == {"vision": 0, "language": len(out.prompt_token_ids) + NEW_TOKENS - 1}
        assert llm.engine.runner.model.expert_tokens.route is None
        rows.update(vision=0, language=0)
        img = random_image(11, (66, 77))
        out = llm.generate(prompt(tok, "What is it?", img), PARAMS, use_tqdm=False)[0]
        check(out, ref, tok, "What is it?", img)
        assert rows == {"vision": IMAGE_TOKENS - 1,
                        "language": len(out.prompt_token_ids) - (IMAGE_TOKENS - 1) + NEW_TOKENS - 1}
    finally:
        for h in handles:
            h.remove()


def test_piecewise_path_takes_image_free_steps_and_leaves_routed_ones_eager(setup):
    """With piecewise segments (run eagerly on CPU, the buffers and padding of the GPU path), steps
    without image rows run the plain Llama segments and steps with them the routed layers eagerly;
    the tokens stay the reference's."""
    from splitserve.worker.cuda_graphs import PiecewiseGraphs
    _, ref, tok, path = setup
    llm = LLM(path, num_blocks=128, block_size=BLOCK, max_num_batched_tokens=32, max_model_len=1024)
    runner = llm.engine.runner
    runner.piecewise = PiecewiseGraphs(runner.model, [8, 32], runner.device, use_graphs=False)
    assert not runner.piecewise.accepts_embeds
    cases = [("What is this?", random_image(12, (70, 60))), ("Plain text, no picture at all.", None)]
    outs = llm.generate([prompt(tok, t, i) for t, i in cases], PARAMS, use_tqdm=False)
    for out, (text, img) in zip(outs, cases):
        check(out, ref, tok, text, img)
    assert runner.steps_by_path["piecewise"] > 0 and runner.steps_by_path["eager"] > 0
