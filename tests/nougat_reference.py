"""Tiny random Nougat checkpoints (VisionEncoderDecoderModel: Donut-Swin + mBART), rendered pages of
text, and transformers' greedy reference."""
import torch
from PIL import Image, ImageDraw

from splitserve.loading.resolve import load_tokenizer

NEW_TOKENS = 8
PAGE = {"height": 64, "width": 48}  # the processor's canvas: 16 x 12 patches of 4, 4 x 3 after two merges


def text_page(lines, size=(170, 220), margin=(18, 25), seed=0) -> Image.Image:
    """A page of text drawn with PIL: white margins (the processor crops them), a title, lines."""
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    x, y = margin
    for i, line in enumerate(lines):
        d.text((x + (seed * 3) % 7, y), line, fill="black")
        y += 14 if i else 20
    d.line([(x, y + 4), (size[0] - margin[0], y + 4)], fill="gray", width=1)
    return img


def make_tiny_nougat(path):
    """A random tiny Nougat with the default tokenizer and a PIL Nougat image processor of a small
    page, saved to path; returns (path, the transformers model, its image processor)."""
    from transformers import (DonutSwinConfig, MBartConfig, VisionEncoderDecoderConfig,
                              VisionEncoderDecoderModel)
    from transformers.models.nougat.image_processing_pil_nougat import NougatImageProcessorPil
    tok = load_tokenizer(None)
    encoder = DonutSwinConfig(image_size=[PAGE["height"], PAGE["width"]], patch_size=4, embed_dim=16,
                              depths=[2, 2, 2], num_heads=[2, 4, 4], window_size=3)
    decoder = MBartConfig(is_decoder=True, is_encoder_decoder=False, add_cross_attention=True, decoder_layers=2,
                          decoder_attention_heads=4, decoder_ffn_dim=96, d_model=64, max_position_embeddings=2048,
                          vocab_size=len(tok), scale_embedding=True, tie_word_embeddings=False,
                          eos_token_id=tok.eos_token_id, activation_function="gelu")
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    torch.manual_seed(0)
    model = VisionEncoderDecoderModel(config=config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # LayerNorms off identity, so a wrong norm shows
                param.add_(torch.randn_like(param) * 0.2)
            elif "relative_position_bias_table" in name or "embed_positions" in name or "lm_head" in name:
                param.normal_(0.0, 0.5)  # position terms that matter, logits that are not all alike
            elif "encoder_attn" in name and "weight" in name:
                param.normal_(0.0, 0.4)  # the page weighs on every token
    model.save_pretrained(path)
    tok.save_pretrained(path)
    NougatImageProcessorPil(size=dict(PAGE)).save_pretrained(path)
    return str(path), model, NougatImageProcessorPil.from_pretrained(path)


@torch.inference_mode()
def hf_greedy(model, processor, img, new_tokens=NEW_TOKENS):
    pixels = processor(images=[img], return_tensors="pt")["pixel_values"]
    out = model.generate(pixel_values=pixels, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         forced_eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, 1:].tolist()
    return tokens, [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, tokens)]
