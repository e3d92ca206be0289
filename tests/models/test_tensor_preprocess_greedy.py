"""The tensor preprocessing path (`mm_preprocess="cpu"`, multimodal/tensor_preprocess.py) end to end:
a tiny random LLaVA-1.5 served with it generates transformers' greedy tokens from transformers' own
processor's pixels (the pixels differ by at most a level of 255 here; the tokens must not), and the
engine did take the tensor path."""
import pytest
import torch
import transformers

from splitserve import LLM, SamplingParams
from splitserve.multimodal.tensor_preprocess import ClipStyleTensorProcessor
from tests.multimodal_reference import hf_greedy_mm, hf_processor, make_tiny_llava_dir, mm_tokenizer, random_image

NEW_TOKENS = 10
PROMPTS = [
    ("USER: <image>\nWhat is shown here? ASSISTANT:", [(80, 60)]),
    ("Compare <image> with <image> please.", [(50, 90), (64, 64)]),
    ("<image> Describe it.", [(120, 40)]),
]


@pytest.mark.parametrize("tower", ["clip", "siglip"])
def test_tensor_preprocessing_keeps_transformers_greedy_tokens(tower, tmp_path):
    tokenizer = mm_tokenizer()
    path = make_tiny_llava_dir(tmp_path / tower, tokenizer, tower=tower, seed=3)
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processor = hf_processor(path, tokenizer, tower, anyres=False)
    images = [[random_image(10 * i + j, size) for j, size in enumerate(sizes)] for i, (_, sizes) in enumerate(PROMPTS)]

    llm = LLM(path, num_blocks=64, block_size=16, mm_preprocess="cpu")
    assert isinstance(llm.engine.mm_processor.image_processor, ClipStyleTensorProcessor)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": imgs}} for (t, _), imgs in zip(PROMPTS, images)],
                        params, use_tqdm=False)
    for (text, _), imgs, out in zip(PROMPTS, images, outs):
        inputs = processor(text=text, images=imgs, return_tensors="pt")
        assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
        ref_tokens, _ = hf_greedy_mm(hf, dict(inputs), NEW_TOKENS)
        assert out.outputs[0].token_ids == ref_tokens, text
