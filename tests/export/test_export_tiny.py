"""A tiny random Llama with GQA, exported: the graphs are valid ONNX with one cut per layer; the graph
with the op's function inlined reproduces transformers' prefill logits with no plugin; served by the
onnxruntime backend it gives the torch engine's greedy tokens (and log-probabilities) for 16
concurrent prompts, with chunked prefill and prefix hits in the engine's own KV pool."""
import json

import numpy as np
import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.loading.onnx_export import MANIFEST
from splitserve.loading.resolve import load_tokenizer
from tests.export.export_reference import (assert_one_cut_per_layer, check_all, inlined_session, run_prefill,
                                           shared_prefix_prompts)
from tests.hf_reference import make_tiny_llama_dir

pytest.importorskip("onnxruntime_extensions")
GRAPHS = ["batchful.onnx", "embed_tokens.onnx", "batchless_prefill.onnx", "batchless_decode.onnx"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from splitserve.export.exporter import export_model
    root = tmp_path_factory.mktemp("tiny")
    hf_dir = make_tiny_llama_dir(root / "hf", load_tokenizer(None), num_kv_heads=2, tie=False, seed=3)
    out = str(root / "onnx")
    export_model(hf_dir, out)
    return hf_dir, out


def test_graphs_are_valid_with_one_cut_per_layer(exported):
    _, out = exported
    check_all(out, GRAPHS)
    assert_one_cut_per_layer(f"{out}/batchful.onnx", 2)
    manifest = json.load(open(f"{out}/{MANIFEST}"))
    assert manifest["heads"] == {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16}
    assert manifest["num_layers"] == 2 and manifest["dtype"] == "float32"
    assert manifest["graphs"]["batchful"]["inputs"]["inputs_embeds"]["shape"][0] == "tokens"


def test_inlined_function_prefill_matches_transformers(exported):
    from transformers import AutoModelForCausalLM
    hf_dir, out = exported
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.tensor(shared_prefix_prompts(hf.config.vocab_size, 2, seed=5)[1])
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
        embeds = hf.get_input_embeddings()(ids)
    got = run_prefill(inlined_session(f"{out}/batchful.onnx"), embeds)
    assert np.abs(got - want.numpy()).max() <= 1e-4


def test_served_greedy_tokens_match_the_torch_engine(exported):
    from splitserve.attention import onnx_plugin
    hf_dir, out = exported
    prompts = shared_prefix_prompts(len(load_tokenizer(None)), 16, seed=1)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)
    # a small budget chunks the prefills; the second half's shared prefix hits the cache
    kw = dict(num_blocks=128, max_num_batched_tokens=64)
    calls = onnx_plugin.num_calls()
    onnx_llm = LLM(out, **kw)
    assert onnx_llm.engine.config.onnx is not None
    got = onnx_llm.generate(prompts, params, use_tqdm=False)
    assert onnx_plugin.num_calls() > calls  # the plugin ran the batchless part, not an inlined body
    want = LLM(hf_dir, **kw).generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        lp = [d[t] for d, t in zip(g.outputs[0].logprobs, g.outputs[0].token_ids)]
        assert lp == pytest.approx([d[t] for d, t in zip(w.outputs[0].logprobs, w.outputs[0].token_ids)], abs=1e-4)
    assert onnx_llm.engine.kv_manager.pool.is_whole()
    assert onnx_llm.engine.kv_manager.prefix_hits > 0


def test_backend_choice_is_checked_at_start(exported):
    from splitserve.engine.args import EngineArgs
    hf_dir, out = exported
    with pytest.raises(ValueError, match="splitserve export"):
        EngineArgs(model=hf_dir, backend="onnxruntime").create_engine_config()
    with pytest.raises(ValueError, match="onnxruntime backend only"):
        EngineArgs(model=out, backend="torch").create_engine_config()
    with pytest.raises(ValueError, match="exported in float32"):
        EngineArgs(model=out, dtype="float16").create_engine_config()
    with pytest.raises(ValueError, match="does not support --enable-lora"):
        EngineArgs(model=out, enable_lora=True).create_engine_config()
    assert EngineArgs(model=out).create_engine_config().onnx.directory == out
