"""The default model (SmolLM2-135M GGUF) through `splitserve export` once: valid graphs with 30 cuts
and no attention outside them; the inlined graph reproduces the engine's prefill logits; LLM(DIR) on
the onnxruntime backend gives the torch engine's greedy tokens for 16 concurrent prompts; and
`splitserve serve DIR` answers a completion with the same tokens."""
import json
import time

import numpy as np
import pytest

from splitserve import LLM, SamplingParams
from splitserve.entrypoints.cli import main
from tests.export.export_reference import (assert_one_cut_per_layer, check_all, engine_prefill_logits,
                                           inlined_session, run_prefill)

pytest.importorskip("onnxruntime_extensions")
CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
         "Explain in one sentence what a CPU does."]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("default") / "onnx")
    t = time.perf_counter()
    assert main(["export", "--output", out]) == 0
    print(f"default model exported in {time.perf_counter() - t:.1f} s")  # the issue asks < 60 s: see the report
    return out


@pytest.fixture(scope="module")
def torch_llm():
    return LLM(num_blocks=256, max_num_batched_tokens=512)


def test_graphs_hold_one_cut_per_layer(exported):
    check_all(exported, ["batchful.onnx", "embed_tokens.onnx", "batchless_prefill.onnx", "batchless_decode.onnx"])
    assert_one_cut_per_layer(f"{exported}/batchful.onnx", 30)
    manifest = json.load(open(f"{exported}/splitserve_export.json"))
    assert manifest["heads"] == {"num_heads": 9, "num_kv_heads": 3, "head_dim": 64}


def test_inlined_prefill_matches_the_engine(exported, torch_llm):
    ids = torch_llm.apply_chat_template([{"role": "user", "content": CHATS[0]}])
    want = engine_prefill_logits(torch_llm, ids)
    embeds = torch_llm.engine.runner.model.embed(__import__("torch").tensor(ids))
    got = run_prefill(inlined_session(f"{exported}/batchful.onnx"), embeds)
    # fp32 over 30 layers, logits up to ~30: measured max 1.1e-4, mean 1.4e-5 (the same with ONNX Runtime's
    # graph optimisations off: MLAS's GEMMs and the norm's Sqrt + Reciprocal round differently from torch's)
    assert np.abs(got - want.numpy()).max() <= 2e-4
    assert np.abs(got - want.numpy()).mean() <= 3e-5


def test_served_greedy_tokens_match_the_torch_engine(exported, torch_llm):
    prompts = [torch_llm.apply_chat_template([{"role": "user", "content": CHATS[i % 4] + " " * (i // 4)}])
               for i in range(16)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
    want = torch_llm.generate(prompts, params, use_tqdm=False)
    onnx_llm = LLM(exported, num_blocks=256, max_num_batched_tokens=512)
    got = onnx_llm.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        lp = [d[t] for d, t in zip(g.outputs[0].logprobs, g.outputs[0].token_ids)]
        assert lp == pytest.approx([d[t] for d, t in zip(w.outputs[0].logprobs, w.outputs[0].token_ids)], abs=1e-3)
    assert onnx_llm.engine.kv_manager.pool.is_whole()


def test_serve_dir_answers_like_the_engine(exported, torch_llm):
    import httpx

    from tests.e2e.conftest import ServerProcess
    srv = ServerProcess([exported, "--max-model-len", "1024", "--max-num-seqs", "8", "--disable-access-log"])
    try:
        srv.wait_healthy()
        r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
            "model": "onnx", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        want = torch_llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0),
                                  use_tqdm=False)[0].outputs[0].text
        assert r.json()["choices"][0]["text"] == want
    finally:
        srv.stop()
