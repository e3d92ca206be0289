"""A tiny random LLaVA-1.5 exported with its visual encoder (tower + projector): the graphs are valid,
and the onnxruntime backend (image features from visual_encoder.onnx placed among embed_tokens.onnx's
embeddings, the decoder in batchful.onnx) gives the torch engine's greedy tokens for 16 concurrent
prompts mixing text and images, with chunked prefills splitting the image runs."""
import pytest

from splitserve import LLM, SamplingParams
from tests.export.export_reference import assert_one_cut_per_layer, check_all
from tests.multimodal_reference import make_tiny_llava_dir, mm_tokenizer, random_image

pytest.importorskip("onnxruntime_extensions")
PROMPTS = [("The quick brown fox jumps over the lazy dog.", []), ("USER: <image>\nWhat is shown here? ASSISTANT:", [(80, 60)]),
           ("Compare <image> with <image> please.", [(50, 90), (64, 64)]), ("<image> Describe it.", [(120, 40)])]


def test_llava_exports_and_serves_like_the_torch_engine(tmp_path):
    from splitserve.export.exporter import export_model
    hf_dir = make_tiny_llava_dir(tmp_path / "hf", mm_tokenizer(), seed=4)
    out = str(tmp_path / "onnx")
    manifest = export_model(hf_dir, out)
    assert set(manifest["graphs"]) == {"batchful", "embed_tokens", "visual_encoder", "batchless_prefill",
                                       "batchless_decode"}
    check_all(out, ["batchful.onnx", "embed_tokens.onnx", "visual_encoder.onnx"])
    assert_one_cut_per_layer(f"{out}/batchful.onnx", 2)

    requests = []
    for i in range(16):
        text, sizes = PROMPTS[i % 4]
        images = [random_image(10 * i + j, size) for j, size in enumerate(sizes)]
        requests.append({"prompt": text, "multi_modal_data": {"image": images}} if images else text + " " * (i // 4))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    kw = dict(num_blocks=256, block_size=16, max_num_batched_tokens=48)
    onnx_llm = LLM(out, **kw)
    got = onnx_llm.generate(requests, params, use_tqdm=False)
    want = LLM(hf_dir, **kw).generate(requests, params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert g.prompt_token_ids == w.prompt_token_ids
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        lp = [d[t] for d, t in zip(g.outputs[0].logprobs, g.outputs[0].token_ids)]
        assert lp == pytest.approx([d[t] for d, t in zip(w.outputs[0].logprobs, w.outputs[0].token_ids)], abs=1e-4)
    assert onnx_llm.engine.kv_manager.pool.is_whole()
    assert onnx_llm.engine.runner.mm.num_images_encoded == 16 // 4 * 4  # each distinct image once
