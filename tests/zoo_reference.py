"""Tiny random BLIP-2 (OPT or T5) and Fuyu checkpoints saved by transformers, and their greedy references."""
from __future__ import annotations

import numpy as np
import torch

from tests.multimodal_reference import IMAGE, _randomize, pil_class

BLIP_SIDE = 56        # BLIP-2 image side: 4x4 patches of 14 px
NUM_QUERY = 8


def opt_text_config(tokenizer, **overrides) -> dict:
    kw = dict(model_type="opt", vocab_size=len(tokenizer), hidden_size=64, ffn_dim=128, num_hidden_layers=2,
              num_attention_heads=4, word_embed_proj_dim=64, max_position_embeddings=1024,
              bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
              pad_token_id=tokenizer.pad_token_id or 0)
    kw.update(overrides)
    return kw


def make_tiny_blip2_dir(path, tokenizer, seed: int = 0, text_config: dict | None = None) -> str:
    """A tiny BLIP-2 checkpoint; the language model is OPT unless text_config says otherwise (T5)."""
    from transformers import Blip2Config, Blip2ForConditionalGeneration
    config = Blip2Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=BLIP_SIDE, patch_size=14, layer_norm_eps=1e-6),
        # three layers: cross-attention in layers 0 and 2, not in 1
        qformer_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                            cross_attention_frequency=2),
        text_config=text_config or opt_text_config(tokenizer), num_query_tokens=NUM_QUERY,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE))
    model = Blip2ForConditionalGeneration(config)
    _randomize(model, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    pil_class("BlipImageProcessor")(size={"height": BLIP_SIDE, "width": BLIP_SIDE}).save_pretrained(path)
    return str(path)


def blip2_processor(path, tokenizer):
    from transformers import Blip2Processor

    from splitserve.multimodal.processor import load_image_processor
    return Blip2Processor(image_processor=load_image_processor(str(path)), tokenizer=tokenizer,
                          num_query_tokens=NUM_QUERY)


@torch.inference_mode()
def hf_greedy(model, max_new_tokens: int, **inputs) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probabilities from transformers' generate."""
    ids = inputs["input_ids"]
    inputs.setdefault("attention_mask", torch.ones_like(ids))
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    seq = out.sequences[0]
    tokens = seq[ids.shape[1]:].tolist() if seq.shape[0] > max_new_tokens else seq.tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
    return tokens, logprobs


# -- Fuyu ------------------------------------------------------------------------------------------------
FUYU_PATCH = 15
FUYU_CANVAS = {"height": 60, "width": 90}   # at most 4 x 6 patches
FUYU_TOKENS = ["|SPEAKER|", "|NEWLINE|", "<0x04>"]


def fuyu_tokenizer():
    """The default model's tokenizer plus Fuyu's image, row-end and beginning-of-answer tokens."""
    from tests.multimodal_reference import mm_tokenizer
    tok = mm_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [IMAGE] + FUYU_TOKENS})
    return tok


def make_tiny_fuyu_dir(path, tokenizer, seed: int = 0) -> str:
    from transformers import FuyuConfig, FuyuForCausalLM
    text = dict(model_type="persimmon", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, qk_layernorm=True, hidden_act="relu2",
                max_position_embeddings=1024, layer_norm_eps=1e-5, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 25000.0, "partial_rotary_factor": 0.5})
    config = FuyuConfig(text_config=text, patch_size=FUYU_PATCH, image_token_id=tokenizer.convert_tokens_to_ids("|SPEAKER|"))
    model = FuyuForCausalLM(config)
    _randomize(model, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    pil_class("FuyuImageProcessor")(size=FUYU_CANVAS, patch_size={"height": FUYU_PATCH, "width": FUYU_PATCH}
                                    ).save_pretrained(path)
    return str(path)


class _TorchFuyuImages:
    """The PIL flavour of FuyuImageProcessor returns numpy lists where FuyuProcessor expects the
    torchvision flavour's tensors; this hands FuyuProcessor tensors and its patchify numpy."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, images, **kwargs):
        out = self.inner(images)
        out["images"] = torch.stack([torch.from_numpy(np.stack(batch)) for batch in out["images"]])
        return out

    def patchify_image(self, image, patch_size=None):
        return torch.from_numpy(self.inner.patchify_image(np.asarray(image), patch_size=patch_size))


def fuyu_reference_inputs(path, tokenizer, text: str, img) -> dict:
    """transformers' FuyuProcessor grid and patches for one image; its replacement text (rows of
    |SPEAKER| ending in |NEWLINE|, then <s>) tokenized with this tokenizer's BOS for <s>; the text
    and <0x04> after it: FuyuProcessor's prompt layout."""
    import copy

    from transformers import FuyuProcessor

    from splitserve.multimodal.processor import load_image_processor
    proc = FuyuProcessor(image_processor=load_image_processor(str(path)), tokenizer=copy.deepcopy(tokenizer))
    proc.image_processor = _TorchFuyuImages(proc.image_processor)
    images, replacements = proc._process_images([img], return_legacy_image_output=False)
    run = replacements[0].replace("<s>", tokenizer.bos_token)
    ids = tokenizer.encode(run + text + "<0x04>", add_special_tokens=False)
    return {"input_ids": torch.tensor([ids]), "pixel_values": images["pixel_values"][None]}


def run_abort_storm(path, make_prompts, num_blocks: int = 14, budget: int = 20) -> None:
    """Aborts at random moments under preemption (a tight pool) and image runs split across prefill
    chunks; survivors keep the greedy tokens of an unconstrained engine, and nothing leaks.
    make_prompts(mm_processor, rng) yields the prompts (token ids, images already expanded)."""
    import random

    from splitserve import LLM, SamplingParams
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ref_llm = LLM(path, num_blocks=512, block_size=8, max_num_batched_tokens=2048, enable_prefix_caching=False)
    rng = random.Random(3)
    prompts = list(make_prompts(ref_llm.engine.mm_processor, rng))
    want = [o.outputs[0].token_ids for o in ref_llm.generate(prompts, params, use_tqdm=False)]

    llm = LLM(path, num_blocks=num_blocks, block_size=8, max_num_batched_tokens=budget, max_num_seqs=8)
    engine = llm.engine
    ids = [engine.add_request(f"r{i}", p, params, stream=False) for i, p in enumerate(prompts)]
    doomed, aborted, finished = set(rng.sample(ids, len(ids) * 2 // 5)), set(), {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out
        for rid in sorted(doomed - aborted):
            if rid in engine.states and rng.random() < 0.2:
                engine.abort_request(rid)
                aborted.add(rid)
    assert engine.scheduler.num_preemptions > 0 and aborted
    for i, rid in enumerate(ids):
        if rid not in aborted:
            assert finished[rid].outputs[0].token_ids == want[i], rid
    assert engine.kv_manager.pool.is_whole()
    assert engine.runner.mm.cache.num_pinned() == 0 and engine.runner.mm.cache.is_whole()
    assert not engine.scheduler.requests and not engine.states


# -- Kosmos-2 --------------------------------------------------------------------------------------------
KOSMOS_SIDE = 56
KOSMOS_QUERIES = 64


def kosmos2_processor(image_processor=None, tokenizer=None):
    """transformers' Kosmos2Processor on the default model's tokenizer (it adds Kosmos-2's tag and
    1024 patch-index tokens). The unknown token (image slot ids start after it) is <|im_end|> (id 2)
    and padding <|endoftext|> (id 0), so the 64 slot ids 3..66 never include the padding id
    (transformers' positions skip padding ids)."""
    from transformers import Kosmos2Processor

    from splitserve.loading.resolve import load_tokenizer
    if tokenizer is None:
        tokenizer = load_tokenizer(None)
        tokenizer.unk_token = "<|im_end|>"
        tokenizer.pad_token = "<|endoftext|>"
    if image_processor is None:
        image_processor = pil_class("CLIPImageProcessor")(size={"height": KOSMOS_SIDE, "width": KOSMOS_SIDE},
                                                          do_center_crop=False)
    return Kosmos2Processor(image_processor, tokenizer)


def make_tiny_kosmos2_dir(path, seed: int = 0):
    from transformers import Kosmos2Config, Kosmos2ForConditionalGeneration
    proc = kosmos2_processor()
    tok = proc.tokenizer
    config = Kosmos2Config(
        text_config=dict(vocab_size=len(tok), embed_dim=64, layers=2, ffn_dim=128, attention_heads=4,
                         max_position_embeddings=1024, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, scale_embedding=True, activation_function="gelu"),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=KOSMOS_SIDE, patch_size=14),
        latent_query_num=KOSMOS_QUERIES)
    model = Kosmos2ForConditionalGeneration(config)
    _randomize(model, seed)
    model.save_pretrained(path)
    proc.save_pretrained(path)
    return str(path), proc


def generate_on_piecewise_path(path, requests, params):
    """Runs requests with every step on the piecewise-graph path (its segments, static buffers and
    bucket padding, without graphs on CPU): steps with image tokens start from the embeddings buffer."""
    from splitserve import LLM
    from splitserve.worker.cuda_graphs import PiecewiseGraphs
    llm = LLM(path, num_blocks=128, block_size=16, max_num_batched_tokens=32)
    runner = llm.engine.runner
    runner.piecewise = PiecewiseGraphs(runner.model, [8, 32], runner.device, use_graphs=False)
    assert runner.piecewise.accepts_embeds
    outs = llm.generate(requests, params, use_tqdm=False)
    assert runner.steps_by_path["piecewise"] > 0 and runner.steps_by_path["eager"] == 0
    assert llm.engine.kv_manager.pool.is_whole() and runner.mm.cache.is_whole()
    return outs


def assert_matches_reference(out, want: tuple[list[int], list[int], list[float]], label: str) -> None:
    """An engine output against the reference's (prompt ids, greedy tokens, their logprobs)."""
    import pytest
    want_ids, want_tokens, want_logprobs = want
    assert out.prompt_token_ids == want_ids, label
    got = out.outputs[0]
    assert got.token_ids == want_tokens, label
    assert [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)] == pytest.approx(want_logprobs, abs=5e-4)


def check_prefix_and_encoder_cache_hits(path, text: str, other_text: str, budget: int, params,
                                        reference_tokens) -> None:
    """A model whose prompt opens with its image: the same image + text again hits the prefix cache
    up to the last whole block; another image shares no block; other text after the first image is
    served from the encoder cache and still equals the reference's tokens (reference_tokens(text,
    images) -> greedy tokens)."""
    from splitserve import LLM
    from tests.multimodal_reference import random_image
    llm = LLM(path, num_blocks=64, block_size=8, max_num_batched_tokens=budget)
    mm = llm.engine.runner.mm
    img, other = random_image(41, (70, 50)), random_image(42, (70, 50))
    first = llm.generate({"prompt": text, "multi_modal_data": {"image": img}}, params, use_tqdm=False)[0]
    n = len(first.prompt_token_ids)
    again = llm.generate({"prompt": text, "multi_modal_data": {"image": img}}, params, use_tqdm=False)[0]
    assert again.num_cached_tokens == (n - 1) // 8 * 8 and again.outputs[0].token_ids == first.outputs[0].token_ids
    third = llm.generate({"prompt": text, "multi_modal_data": {"image": other}}, params, use_tqdm=False)[0]
    assert third.num_cached_tokens == 0  # the image (after at most BOS and a marker) fills the first block
    encoded = mm.num_images_encoded
    fourth = llm.generate({"prompt": other_text, "multi_modal_data": {"image": img}}, params, use_tqdm=False)[0]
    assert mm.num_images_encoded == encoded  # served from the encoder cache
    assert fourth.outputs[0].token_ids == reference_tokens(other_text, [img])
    assert llm.engine.kv_manager.pool.is_whole() and mm.cache.is_whole()
