"""One sequence of a symmetric int4 GPTQ model through the compiled decode-graph path at batch size 1
(Inductor on CPU, the decode graph run without CUDA graphs): the layer halves compile one more time,
for one token, and nothing falls back to eager; the greedy tokens match transformers running the
dequantized weights (the reference of test_wna16_checkpoints.py), and the same engine at batch 2 (a
padded row) gives the same tokens."""
import functools

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.loading.resolve import load_tokenizer
from splitserve.worker.cuda_graphs import DecodeGraphs
from splitserve.worker.model_runner import compile_decoder_layers
from tests.quant_reference import compare_greedy, hf_greedy_logprobs
from tests.wna16_reference import make_gptq_or_awq

NEW_TOKENS = 10
TOL = 0.02  # as test_wna16_checkpoints.py: the same float32 weights, another summation order
PROMPT = [17, 934, 2201, 88, 4102, 9, 311, 15000, 4, 61]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_gptq_or_awq(tmp_path_factory.mktemp("gptq"), load_tokenizer(None), "gptq", 4, 128, symmetric=True,
                            seed=3)


def compiled_engine(path, monkeypatch, sizes):
    """The engine with its layer halves compiled as on CUDA (compile_decoder_layers, counted) and a
    decode-graph runner of `sizes` that runs its forward instead of replaying."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    llm = LLM(path, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=4, enable_prefix_caching=False)
    runner = llm.engine.runner
    counter = CompileCounterWithBackend("inductor")
    with monkeypatch.context() as m:
        m.setattr(torch, "compile", functools.partial(torch.compile, backend=counter))
        compile_decoder_layers(runner.model)
    cfg = runner.config.model
    runner.graphs = DecodeGraphs(runner.model, runner.backend, sizes, runner.max_blocks_per_seq, cfg.max_model_len,
                                 runner.kv_layout()[1], runner.device, use_graphs=False)
    padded = []
    run = runner.graphs.run
    runner.graphs.run = lambda n, *a: padded.append(runner.graphs.padded_size(n)) or run(n, *a)
    return llm, counter, padded


def greedy(llm):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    return out.token_ids, [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]


def test_one_sequence_runs_the_compiled_size_one_graph(checkpoint, monkeypatch):
    path, ref = checkpoint
    ref_tokens, ref_lp = hf_greedy_logprobs(ref, PROMPT, NEW_TOKENS)

    sizes = [1, 2, 4]
    llm, counter, padded = compiled_engine(path, monkeypatch, sizes)
    layer = llm.engine.runner.model.layers[0].self_attn.qkv_proj
    assert llm.engine.config.model.quantization == "gptq: W4A16 (group 128)" and layer.zeros is None
    # Off CUDA the method runs the torch reference, not the GEMV, so it does not ask for size 1; with
    # the GEMV (as on CUDA in bf16) the runner adds it. The graphs here are given those sizes.
    runner = llm.engine.runner
    assert runner.decode_graph_sizes() == sizes[1:]
    quantized = [m for m in runner.model.modules() if getattr(m, "wna16_kernel", None) is False]
    assert len(quantized) == 2 * 4  # qkv, o, gate_up, down per layer; the LM head stays float
    for m in quantized:
        m.wna16_kernel = True
    assert runner.decode_graph_sizes() == sizes
    for m in quantized:
        m.wna16_kernel = False
    tokens, lps = greedy(llm)
    assert padded == [1] * (NEW_TOKENS - 1)  # every decode step ran the graph of one sequence
    # Two halves, each compiled for the prompt (dynamic token count) and once more for one token;
    # every frame compiled (a recompile limit or a graph break would leave it eager).
    assert counter.frame_count == 4
    assert compare_greedy(tokens, lps, ref_tokens, ref_lp, TOL)

    # The graph of two, as before: one sequence padded to two rows, the same tokens, and the halves
    # compiled once each (the padded row keeps the token count dynamic).
    llm2, counter2, padded2 = compiled_engine(path, monkeypatch, [2, 4])
    tokens2, lps2 = greedy(llm2)
    assert padded2 == [2] * (NEW_TOKENS - 1) and counter2.frame_count == 2
    assert tokens2 == tokens
    torch.testing.assert_close(torch.tensor(lps2), torch.tensor(lps), rtol=0, atol=1e-4)
