"""Tensor and pipeline parallelism on CPU over gloo: every rank a process, each building its part of
the model with the ordinary loader and running a fixed schedule of steps (chunked prefill, one-token
steps over cached context, decode) through its own ModelRunner (torch reference attention over the
rank's own KV pool). The reference is the same schedule at TP=1 in this process: same greedy tokens,
logprobs within fp32 tolerance.

The sharded loader is checked slice by slice against the TP=1 parameters, with slices written out
here by hand (not by the loader's own cutting code), and by counting what each rank reads."""
import pytest
import torch

from splitserve.parallel import parallel_state
from splitserve.loading.resolve import ModelSource, default_model_source, load_tokenizer
from tests.hf_reference import make_tiny_llama_dir
from tests.tp_harness import assert_same_steps, build_runner, run_ranks, run_schedule


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def _source(path) -> ModelSource:
    return ModelSource("tiny", str(path))


def _schedule_rank(rank: int, source: ModelSource, decode: bool):
    from splitserve.parallel.parallel_state import pp_group
    runner = build_runner(source)
    steps = run_schedule(runner, prompt_seed=7, decode=decode)
    layers, kv_heads = runner.kv_layout()
    compiled = _compiled_half_matches(runner.model) if pp_group().world_size == 1 else None
    return {"steps": steps, "kv_layers": layers, "kv_heads": kv_heads,
            "kv_cache_shape": tuple(runner.kv_caches[0].shape), "compiled": compiled}


def _compiled_half_matches(model) -> bool:
    """The layer half after attention (o_proj's all-reduce, MLP, down_proj's all-reduce) traced whole
    by torch.compile (fullgraph: the collectives are custom ops with fake implementations) gives
    the eager result."""
    layer = model.layers[0]
    gen = torch.Generator().manual_seed(0)
    attn_out = torch.randn(5, layer.self_attn.num_heads * layer.self_attn.head_dim, generator=gen)
    residual = torch.randn(5, model.config.hidden_size, generator=gen)
    compiled = torch.compile(layer.attn_outputs, fullgraph=True, dynamic=True, backend="aot_eager")
    with torch.inference_mode():
        got, want = compiled(attn_out, residual), layer.attn_outputs(attn_out, residual)
    return all(torch.allclose(g, w, atol=1e-6) for g, w in zip(got, want))


def test_tp2_tiny_llama_with_biases_and_padded_vocab(tokenizer, tmp_path):
    """8 query / 2 KV heads over 2 ranks (one KV head each); q/k/v/o and MLP biases (the row-parallel
    ones added once, after the all-reduce); a vocabulary of 1001 (the last rank's rows padded)."""
    path = make_tiny_llama_dir(tmp_path / "m", tokenizer, num_kv_heads=2, tie=False, num_attention_heads=8,
                               vocab_size=1001, attention_bias=True, mlp_bias=True)
    want = run_schedule(build_runner(_source(path)), prompt_seed=7, decode=True)
    ranks = run_ranks(_schedule_rank, 2, 1, _source(path), True)
    for r in ranks:
        assert_same_steps(r["steps"], want)
        # each rank caches its own KV head: half the pool of TP=1 per block
        assert r["kv_heads"] == 1 and r["kv_cache_shape"] == (4, 2, 16, 1, 8)
        assert r["compiled"]


@pytest.mark.slow  # loads the real model four times (like tests/models/, which is slow by its path)
def test_tp3_default_model(tmp_path):
    """SmolLM2-135M (9 query / 3 KV heads, tied embedding, GGUF): three ranks of 3 + 1 heads."""
    source = default_model_source()
    want = run_schedule(build_runner(source), prompt_seed=7, decode=True)
    ranks = run_ranks(_schedule_rank, 3, 1, source, True)
    for r in ranks:
        assert_same_steps(r["steps"], want)
        assert r["kv_heads"] == 1 and r["kv_layers"] == 30


@pytest.mark.slow
def test_tp2_pp2_tiny_llama(tokenizer, tmp_path):
    """World 4: two pipeline stages of two tensor-parallel ranks; 3 layers (2 on the first stage,
    1 on the last), a tied embedding (the last stage loads its own copy as the head). The worker's
    StageRunner moves (hidden, residual) between stages; rank 2 (last stage, tensor rank 0) samples
    and broadcasts the tokens, so every rank decodes on them."""
    path = make_tiny_llama_dir(tmp_path / "m", tokenizer, num_kv_heads=2, tie=True, num_attention_heads=8,
                               num_hidden_layers=3, vocab_size=1001)
    want = run_schedule(build_runner(_source(path)), prompt_seed=7, decode=True)
    ranks = run_ranks(_schedule_rank, 2, 2, _source(path), True)
    assert [r["kv_layers"] for r in ranks] == [2, 2, 1, 1]
    assert_same_steps(ranks[2]["steps"], want)
    for r in ranks:
        assert [s["tokens"] for s in r["steps"]] == [s["tokens"] for s in want]


# -- start-up errors ---------------------------------------------------------------------------------
@pytest.mark.parametrize("heads,kv_heads,tp,message", [
    (9, 3, 2, "9 query heads do not divide by the tensor-parallel size 2"),
    (8, 6, 4, "6 KV heads do not divide by the tensor-parallel size 4"),
    (12, 2, 6, None),  # 2 KV heads replicated over 6 ranks: fine
    (12, 4, 6, "4 KV heads cannot be replicated evenly over 6 ranks"),
])
def test_head_counts_that_do_not_split_are_refused(monkeypatch, heads, kv_heads, tp, message):
    from transformers import LlamaConfig

    from splitserve.models.decoder import LlamaForCausalLM
    monkeypatch.setattr(parallel_state, "_TP", parallel_state.ParallelGroup(rank=tp - 1, world_size=tp))
    config = LlamaConfig(vocab_size=96, hidden_size=heads * 4, intermediate_size=tp * 8, num_hidden_layers=1,
                         num_attention_heads=heads, num_key_value_heads=kv_heads)
    if message is None:
        attn = LlamaForCausalLM(config).layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (heads // tp, 1)
        return
    with pytest.raises(ValueError, match=message):
        LlamaForCausalLM(config)


def test_pipeline_stages_split_layers_evenly():
    assert [parallel_state.stage_layers(3, s, 2) for s in range(2)] == [(0, 2), (2, 3)]
    assert [parallel_state.stage_layers(10, s, 4) for s in range(4)] == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert [parallel_state.stage_layers(8, s, 4) for s in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="2 decoder layers cannot fill 3 stages"):
        parallel_state.stage_layers(2, 0, 3)


# -- the sharded loader, slice by slice --------------------------------------------------------------
def _expected_part(name: str, full: torch.Tensor, rank: int, tp: int, cfg: dict) -> torch.Tensor:
    """Rank `rank`'s part of a TP=1 parameter, written out per layer kind."""
    q, kv, d = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
        qs, ks = q * d, kv * d
        wq, wk, wv = full[:qs], full[qs:qs + ks], full[qs + ks:]
        nq = q // tp
        kv_head = rank * kv // tp if kv < tp else None
        part_q = wq[rank * nq * d:(rank + 1) * nq * d]
        if kv_head is not None:  # one replicated KV head per rank
            return torch.cat([part_q, wk[kv_head * d:(kv_head + 1) * d], wv[kv_head * d:(kv_head + 1) * d]])
        nk = kv // tp
        return torch.cat([part_q, wk[rank * nk * d:(rank + 1) * nk * d], wv[rank * nk * d:(rank + 1) * nk * d]])
    if name.endswith("gate_up_proj.weight"):
        i = full.shape[0] // 2
        n = i // tp
        return torch.cat([full[rank * n:(rank + 1) * n], full[i + rank * n:i + (rank + 1) * n]])
    if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
        k = full.shape[1] // tp
        return full[:, rank * k:(rank + 1) * k]
    if name in ("embed_tokens.weight", "lm_head.weight"):
        rows = -(-full.shape[0] // tp)
        part = full[rank * rows:(rank + 1) * rows]
        return torch.cat([part, part.new_zeros(rows - part.shape[0], part.shape[1])])
    return full  # norms: replicated


def _params_and_reads(rank: int, source: ModelSource, monkeypatch_reads: bool):
    from splitserve.loading import safetensors_io
    from splitserve.models.loader import load_hf_config, load_model
    read = [0]
    original = safetensors_io.LazySlice.materialize

    def counting(self):
        out = original(self)
        read[0] += out.numel()
        return out
    safetensors_io.LazySlice.materialize = counting
    hf = load_hf_config(source)
    _, model = load_model(source, hf, torch.float32, "cpu")
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "read": read[0]}


def test_sharded_loader_slice_by_slice_with_replicated_kv_head(tokenizer, tmp_path):
    """One KV head (MQA) over 2 ranks: both ranks hold a copy of it. Every parameter of every rank
    equals its part of the TP=1 parameter, and each rank reads from the file exactly the elements
    its parameters hold (safetensors slices, never whole tensors)."""
    cfg = dict(heads=8, kv_heads=1, head_dim=8)
    path = make_tiny_llama_dir(tmp_path / "m", tokenizer, num_kv_heads=1, tie=False, num_attention_heads=8,
                               vocab_size=1001, attention_bias=True)
    from splitserve.models.loader import load_hf_config, load_model
    _, full = load_model(_source(path), load_hf_config(_source(path)), torch.float32, "cpu")
    full_params = dict(full.named_parameters())
    ranks = run_ranks(_params_and_reads, 2, 1, _source(path), True)
    for rank, got in enumerate(ranks):
        # a row-parallel bias is held apart (added after the all-reduce), whole
        params = {n.replace("output_bias", "bias"): p for n, p in got["params"].items()}
        assert set(params) == set(full_params)
        for name, value in params.items():
            want = _expected_part(name, full_params[name].detach(), rank, 2, cfg)
            assert torch.equal(value, want), name
        padding = 2 * (501 * 2 - 1001) * 64 if rank == 1 else 0  # the last rank pads the embedding and the head
        assert got["read"] == sum(p.numel() for p in params.values()) - padding
    # the row-parallel output features and the norms are whole on every rank
    assert ranks[0]["params"]["layers.0.self_attn.o_proj.weight"].shape == (64, 32)
    assert ranks[1]["params"]["lm_head.weight"].shape == (501, 64)
    # and the two ranks' parity with TP=1 on the replicated head
    want = run_schedule(build_runner(_source(path)), prompt_seed=7, decode=True)
    for r in run_ranks(_schedule_rank, 2, 1, _source(path), True):
        assert_same_steps(r["steps"], want)
        assert r["kv_heads"] == 1


# -- a vision-language model: the language model split, the vision tower replicated --------------------
def _vlm_rank(rank: int, source: ModelSource, image_token: int):
    from splitserve.protocol.sched_output import NewRequestData, SchedulerOutput
    from splitserve.protocol.mm_inputs import ImageItem
    from splitserve.sampling_params import SamplingParams
    runner = build_runner(source)
    n = runner.model.tokens_per_tile
    pixels = torch.randn(1, 3, 56, 56, generator=torch.Generator().manual_seed(1))
    prompt = [5, 6] + [image_token] * n + [7, 8, 9]
    item = ImageItem("img", pixels, (56, 56), n, offset=2)
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=5, ignore_eos=True)
    steps = []
    with torch.inference_mode():
        for i in range(3):
            new = [NewRequestData("a", prompt, params, [0], mm_items=(item,))] if i == 0 else []
            count = len(prompt) if i == 0 else 1
            sched = SchedulerOutput(step_id=i, num_scheduled_tokens={"a": count}, total_num_scheduled_tokens=count,
                                    new_requests=new)
            res = runner.collect(runner.launch(sched))
            steps.append({"tokens": res.tokens, "logprobs": res.logprobs})
    return steps


@pytest.mark.slow
def test_tp2_llava_language_model_split_vision_tower_replicated(tmp_path):
    from tests.multimodal_reference import IMAGE, make_tiny_llava_dir, mm_tokenizer
    tokenizer = mm_tokenizer()
    source = ModelSource("llava", make_tiny_llava_dir(tmp_path / "llava", tokenizer, tower="clip"))
    image_token = tokenizer.convert_tokens_to_ids(IMAGE)
    want = _vlm_rank(0, source, image_token)
    for got in run_ranks(_vlm_rank, 2, 1, source, image_token):
        assert_same_steps(got, want)


def test_one_rank_pays_nothing_for_the_collectives():
    """With a group of one the collectives return their input itself, and a compiled row-parallel
    layer's graph holds no collective at all."""
    from splitserve.parallel.communication import tp_all_gather, tp_all_reduce
    from splitserve.layers.parallel_linear import RowParallelLinear
    x = torch.randn(3, 4)
    assert tp_all_reduce(x) is x and tp_all_gather(x) is x
    layer = RowParallelLinear(8, 4, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward
    x = torch.randn(2, 8)
    assert torch.equal(torch.compile(layer, backend=backend, fullgraph=True)(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert graphs and "all_reduce" not in graphs[0] and "linear" in graphs[0]
