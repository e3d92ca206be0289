"""VILA1.5 in VILA's checkpoint layout (llm/, vision_tower/, mm_projector/).

The reference here is independent of splitserve's model code: the projector is re-derived in plain
torch from VILA's published definition (DownSampleBlock + LayerNorm + Linear + GELU + Linear), and
the end-to-end reference runs HF's own SigLIP and Llama on the saved sub-checkpoints, splicing the
re-derived image features in at the image marker (VILA's `tokenizer_image_token` convention).
"""
import math
import os

import pytest
import torch
import torch.nn.functional as F
import transformers

from splitserve import LLM, SamplingParams
from splitserve.loading.resolve import load_tokenizer
from tests.multimodal_reference import make_tiny_vila_dir, pil_class, random_image, vila_projector_state

NEW_TOKENS = 10


def reference_projector(x: torch.Tensor, state: dict) -> torch.Tensor:
    """VILA's mlp_downsample, written out cell by cell. VILA's DownSampleBlock pads the square patch
    grid with zeros to an even side, then (view/permute/view) makes one vector per 2x2 cell ordered
    [(2r, 2c), (2r, 2c+1), (2r+1, 2c), (2r+1, 2c+1)], cells enumerated column-pair first."""
    n, length, c = x.shape
    side = math.isqrt(length)
    even = side + side % 2
    grid = torch.zeros(n, even, even, c, dtype=x.dtype)
    grid[:, :side, :side] = x.view(n, side, side, c)
    tokens = []
    for col in range(even // 2):
        for row in range(even // 2):
            r, k = 2 * row, 2 * col
            tokens.append(torch.cat([grid[:, r, k], grid[:, r, k + 1], grid[:, r + 1, k], grid[:, r + 1, k + 1]], -1))
    merged = torch.stack(tokens, dim=1)
    h = F.layer_norm(merged, (4 * c,), state["layers.1.weight"], state["layers.1.bias"], eps=1e-5)
    h = F.gelu(h @ state["layers.2.weight"].T + state["layers.2.bias"])
    return h @ state["layers.4.weight"].T + state["layers.4.bias"]


@pytest.fixture(scope="module")
def vila(tmp_path_factory):
    tok = load_tokenizer(None)  # no <image> token: VILA splits the text at the marker
    path = make_tiny_vila_dir(tmp_path_factory.mktemp("vila") / "VILA1.5-tiny", tok, image_size=70, seed=5)
    return path, tok, LLM(path, num_blocks=64, max_num_batched_tokens=128)


def test_vila_projector_matches_the_published_definition(vila):
    path, _, llm = vila
    model = llm.engine.runner.model
    state = vila_projector_state(32, 64, seed=5 + 2)
    gen = torch.Generator().manual_seed(0)
    for side in (5, 4):  # odd (padded) and even grids
        x = torch.randn(3, side * side, 32, generator=gen)
        with torch.inference_mode():
            got = model.mm_projector(x)
        assert got.shape == (3, ((side + 1) // 2) ** 2, 64)
        torch.testing.assert_close(got, reference_projector(x, state), rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def reference_vila_greedy(path: str, tok, text: str, image) -> list[int]:
    llm = transformers.LlamaForCausalLM.from_pretrained(os.path.join(path, "llm"), dtype=torch.float32).eval()
    tower = transformers.SiglipVisionModel.from_pretrained(os.path.join(path, "vision_tower"), dtype=torch.float32).eval()
    processor = pil_class("SiglipImageProcessor").from_pretrained(os.path.join(path, "vision_tower"))
    pixels = processor(images=[image], return_tensors="pt")["pixel_values"]
    hidden = tower(pixels, output_hidden_states=True).hidden_states[-2]  # mm_vision_select_layer -2, cls_patch
    feats = reference_projector(hidden, vila_projector_state(32, 64, seed=5 + 2))[0]
    before, after = text.split("<image>")
    ids_before = tok.encode(before, add_special_tokens=True)
    ids_after = tok.encode(after, add_special_tokens=False)
    embed = llm.get_input_embeddings()
    embeds = torch.cat([embed(torch.tensor(ids_before)), feats, embed(torch.tensor(ids_after))])[None]
    out = llm.generate(inputs_embeds=embeds, attention_mask=torch.ones(embeds.shape[:2], dtype=torch.long),
                       max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, -NEW_TOKENS:].tolist()


def test_vila_checkpoint_loads_and_generates_like_the_reference(vila):
    path, tok, llm = vila
    text = "A photo: <image>\nWhat do you see?"
    images = [random_image(40, (90, 70)), random_image(41, (70, 70))]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": [img]}} for img in images], params,
                        use_tqdm=False)
    for img, out in zip(images, outs):
        # 5x5 SigLIP patches -> padded 6x6 -> 9 image tokens in place of the marker
        assert len(out.prompt_token_ids) == len(tok.encode(text.replace("<image>", ""))) + 9
        assert out.outputs[0].token_ids == reference_vila_greedy(path, tok, text, img)
    assert llm.engine.kv_manager.pool.is_whole() and llm.engine.runner.mm.cache.is_whole()
