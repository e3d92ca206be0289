"""Tiny random Pix2Struct (Deplot-style) checkpoints, drawn charts and transformers' greedy reference."""
import torch
from PIL import Image, ImageDraw

from splitserve.models.pix2struct.processor import default_font_path, render_header
from splitserve.loading.resolve import load_tokenizer

NEW_TOKENS = 10
PATCH = {"height": 8, "width": 8}


def bar_chart(values, size, seed=0) -> Image.Image:
    """A bar chart drawn with PIL: axes, one bar per value, a label under each."""
    w, h = size
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    d.line([(10, h - 15), (w - 5, h - 15)], fill="black", width=2)
    d.line([(10, 5), (10, h - 15)], fill="black", width=2)
    step = (w - 20) // len(values)
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]
    for i, v in enumerate(values):
        x0 = 14 + i * step
        d.rectangle([x0, h - 15 - int(v * (h - 25)), x0 + step - 6, h - 16], fill=colors[(i + seed) % len(colors)])
        d.text((x0, h - 13), chr(65 + i), fill="black")
    return img


def make_tiny_deplot(path):
    """A random tiny Pix2Struct (VQA, like Deplot) with the default tokenizer and a PIL image
    processor of 8x8 patches, saved to path; returns (path, the transformers model, its processor)."""
    from transformers import Pix2StructConfig, Pix2StructForConditionalGeneration
    from transformers.models.pix2struct.image_processing_pil_pix2struct import Pix2StructImageProcessorPil
    tok = load_tokenizer(None)
    config = Pix2StructConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=64, d_kv=16, d_ff=96, num_layers=2, num_heads=4,
                         relative_attention_num_buckets=8, relative_attention_max_distance=20, dropout_rate=0.0,
                         eos_token_id=tok.eos_token_id),
        vision_config=dict(hidden_size=64, patch_embed_hidden_size=PATCH["height"] * PATCH["width"] * 3, d_ff=64,
                           d_kv=12, num_hidden_layers=2, num_attention_heads=4, seq_len=128, dropout_rate=0.0),
        is_vqa=True)
    torch.manual_seed(0)
    model = Pix2StructForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    Pix2StructImageProcessorPil(is_vqa=True, max_patches=96, patch_size=PATCH).save_pretrained(path)
    return str(path), model, Pix2StructImageProcessorPil.from_pretrained(path)


def hf_inputs(processor, img, header):
    """transformers' processor for a VQA model: the header rendered above the image (its own
    render_header, with a local font; its call would download Arial), then the patches."""
    rendered = render_header(processor, img, header, default_font_path())
    return processor(images=[rendered], is_vqa=False, return_tensors="pt")


@torch.inference_mode()
def hf_greedy(model, processor, img, header):
    inputs = hf_inputs(processor, img, header)
    out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, 1:].tolist()
    return tokens, [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, tokens)]
