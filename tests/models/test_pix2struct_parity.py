"""Pix2Struct (Deplot-style: the prompt rendered as a header above a drawn bar chart) through the
engine vs transformers' Pix2StructForConditionalGeneration on the same random weights and the same
image processor output: greedy tokens equal, logprobs close, for a batch of charts of different
aspect ratios (different patch grids, so different encoder lengths) and headers, and the pool whole."""
import pytest
import torch
from PIL import Image, ImageDraw

from splitserve import LLM, SamplingParams
from splitserve.models.pix2struct import DEPLOT_PROMPT, default_font_path, render_header
from splitserve.models.resolve import load_tokenizer

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


@pytest.fixture(scope="module")
def deplot_dir(tmp_path_factory):
    from transformers import Pix2StructConfig, Pix2StructForConditionalGeneration
    from transformers.models.pix2struct.image_processing_pil_pix2struct import Pix2StructImageProcessorPil
    tok = load_tokenizer(None)
    path = tmp_path_factory.mktemp("deplot")
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


@torch.inference_mode()
def hf_inputs(processor, img, header):
    """transformers' processor for a VQA model: the header rendered above the image (its own
    render_header, with a local font; its call would download Arial), then the patches."""
    rendered = render_header(processor, img, header, default_font_path())
    return processor(images=[rendered], is_vqa=False, return_tensors="pt")


def hf_greedy(model, processor, img, header):
    inputs = hf_inputs(processor, img, header)
    out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, 1:].tolist()
    return tokens, [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, tokens)]


def test_deplot_charts_match_transformers(deplot_dir):
    path, hf, processor = deplot_dir
    cases = [(bar_chart([0.3, 0.9, 0.5], (120, 80)), DEPLOT_PROMPT),
             (bar_chart([0.7, 0.2, 0.4, 0.8, 0.6], (64, 128), seed=1), DEPLOT_PROMPT),
             (bar_chart([0.5, 0.5], (200, 60), seed=2), "What is the value of bar B?"),
             (bar_chart([0.3, 0.9, 0.5], (120, 80)), DEPLOT_PROMPT)]  # a repeat: same encoder input
    llm = LLM(path, num_blocks=128, block_size=8, max_num_batched_tokens=256, attention_backend="torch_ref")
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt": h, "multi_modal_data": {"image": img}} for img, h in cases], params,
                        use_tqdm=False)
    lengths = set()
    spread = 0.0
    for (img, header), out in zip(cases, outs):
        tokens, logprobs = hf_greedy(hf, processor, img, header)
        comp = out.outputs[0]
        assert comp.token_ids == tokens
        got = [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)]
        assert got == pytest.approx(logprobs, abs=2e-4)
        spread = max([spread, *map(abs, logprobs)])
        lengths.add(int(hf_inputs(processor, img, header)["attention_mask"].sum()))
    assert len(lengths) >= 3  # different patch grids: ragged encoder lengths in one batch
    assert spread > 1e-2
    assert llm.engine.kv_manager.pool.is_whole()
