"""Tensor parallelism of the families whose checkpoints or layers differ from Llama's, on CPU over
gloo (tests/tp_harness.py): each rank loads its part with the ordinary loader (lazy safetensors
slices) and runs the fixed step schedule; the reference is the same schedule at TP=1. Phi-3 cuts
merged qkv_proj / gate_up_proj tensors, StableLM its per-head q/k norms by the rank's heads,
Persimmon its interleaved query_key_value (and row-parallel biases), OPT a plain fc1/fc2 MLP,
learned positions and a tied head."""
import pytest

from splitserve.loading.resolve import ModelSource, load_tokenizer
from tests.hf_reference import make_tiny_hf_dir
from tests.tp_harness import assert_same_steps, build_runner, run_ranks, run_schedule


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def _steps_rank(rank: int, source: ModelSource):
    runner = build_runner(source)
    return {"steps": run_schedule(runner, prompt_seed=7, decode=True), "kv_heads": runner.kv_layout()[1]}


CASES = {
    "phi3": ("phi3", dict(num_attention_heads=8, num_key_value_heads=2)),
    "stablelm": ("stablelm", dict(hidden_size=128, num_key_value_heads=2, qk_layernorm=True, use_qkv_bias=True)),
    "persimmon": ("persimmon", dict(hidden_size=128, num_key_value_heads=None, qk_layernorm=True)),
    "opt": ("opt", dict(ffn_dim=128, num_key_value_heads=None, max_position_embeddings=128)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_family_matches_tp1(case, tokenizer, tmp_path):
    model_type, overrides = CASES[case]
    path = make_tiny_hf_dir(tmp_path / case, tokenizer, model_type, seed=5, vocab_size=1001, **overrides)
    source = ModelSource(case, path)
    want = run_schedule(build_runner(source), prompt_seed=7, decode=True)
    for r in run_ranks(_steps_rank, 2, 1, source):
        assert_same_steps(r["steps"], want)
