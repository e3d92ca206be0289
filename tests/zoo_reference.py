"""Tiny random BLIP-2 (OPT) and Fuyu checkpoints saved by transformers, and their greedy references."""
from __future__ import annotations

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


def make_tiny_blip2_dir(path, tokenizer, seed: int = 0) -> str:
    from transformers import Blip2Config, Blip2ForConditionalGeneration
    config = Blip2Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=BLIP_SIDE, patch_size=14, layer_norm_eps=1e-6),
        # three layers: cross-attention in layers 0 and 2, not in 1
        qformer_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                            cross_attention_frequency=2),
        text_config=opt_text_config(tokenizer), num_query_tokens=NUM_QUERY,
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
