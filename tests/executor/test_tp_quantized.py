"""Quantized checkpoints (written by compressed-tensors, tests/quant_reference.py) sharded over two
ranks: weights and scales cut along the right dimension (per-tensor scales replicated, per-channel
scales split with the output features of column-parallel layers and kept whole by row-parallel
ones, 128x128 block scales cut along both), checked against the TP=1 parameters slice by slice; and
the static-scale and block-wise FP8 models give the TP=1 tokens and logprobs (their activation
quantization does not depend on how the input features are split; dynamic per-token INT8 does, as
in every tensor-parallel engine, so W8A8 is checked by its parameters only)."""
import random

import pytest
import torch

from splitserve.loading.resolve import ModelSource, load_tokenizer
from tests.quant_reference import make_compressed_llama_dir
from tests.tp_harness import assert_same_steps, build_runner, run_ranks, run_schedule

pytestmark = pytest.mark.slow  # writes quantized checkpoints and spawns ranks (about 2 minutes)

VOCAB = 1001
# preset -> checkpoint overrides (block-wise FP8 needs every rank's shard a multiple of 128)
PRESETS = {"FP8": dict(hidden_size=256, num_attention_heads=4),
           "FP8_BLOCK": dict(hidden_size=512, num_attention_heads=4),
           "W8A8": dict(hidden_size=256, num_attention_heads=4)}
PARITY = ("FP8", "FP8_BLOCK")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tokenizer = load_tokenizer(None)
    rng = random.Random(3)
    calibration = [[rng.randrange(3, VOCAB) for _ in range(24)] for _ in range(4)]
    root = tmp_path_factory.mktemp("tpq")
    return {p: make_compressed_llama_dir(root / p, tokenizer, p, calibration, seed=i, vocab_size=VOCAB, **kw)
            for i, (p, kw) in enumerate(PRESETS.items())}


def _rank(rank: int, paths: dict):
    out = {}
    for preset, path in paths.items():
        runner = build_runner(ModelSource(preset, path))
        out[preset] = {"params": {n: p.detach().clone() for n, p in runner.model.named_parameters()},
                       "steps": run_schedule(runner, prompt_seed=5, decode=True) if preset in PARITY else None}
    return out


def _part(full: torch.Tensor, dim: int, rank: int, tp: int = 2) -> torch.Tensor:
    n = full.shape[dim] // tp
    return full.narrow(dim, rank * n, n)


def test_quantized_checkpoints_shard_over_two_ranks(checkpoints):
    ranks = run_ranks(_rank, 2, 1, checkpoints)
    for preset, path in checkpoints.items():
        ref = build_runner(ModelSource(preset, path))
        full = dict(ref.model.named_parameters())
        for rank, got in enumerate(ranks):
            params = got[preset]["params"]
            down_w, down_s = params["layers.0.mlp.down_proj.weight"], params["layers.0.mlp.down_proj.weight_scale"]
            gate_up, full_gate_up = params["layers.0.mlp.gate_up_proj.weight"], full["layers.0.mlp.gate_up_proj.weight"]
            assert gate_up.dtype == full_gate_up.dtype != torch.float32
            # gate/up: the rank's rows of each shard, side by side
            i = full_gate_up.shape[0] // 2
            assert torch.equal(gate_up.float(), torch.cat([_part(full_gate_up[:i], 0, rank),
                                                           _part(full_gate_up[i:], 0, rank)]).float())
            # down_proj: the rank's input columns
            assert torch.equal(down_w.float(), _part(full["layers.0.mlp.down_proj.weight"], 1, rank).float())
            fs = full["layers.0.mlp.down_proj.weight_scale"]
            if preset == "FP8_BLOCK":  # [out blocks, in blocks]: the rank's input blocks
                assert torch.equal(down_s, _part(fs, 1, rank))
            else:  # per-tensor (spread per channel after loading) or per-channel: whole on every rank
                assert torch.equal(down_s, fs)
            gs, fgs = params["layers.0.mlp.gate_up_proj.weight_scale"], full["layers.0.mlp.gate_up_proj.weight_scale"]
            # column-parallel scales follow the rows: the rank's part of each shard
            assert torch.equal(gs, torch.cat([_part(fgs[:fgs.shape[0] // 2], 0, rank),
                                              _part(fgs[fgs.shape[0] // 2:], 0, rank)]))
            if preset in PARITY:
                want = run_schedule(ref, prompt_seed=5, decode=True)
                assert_same_steps(got[preset]["steps"], want, tol=1e-3)


# -- weight-only int4 (GPTQ, AWQ, compressed-tensors pack-quantized) ---------------------------------------
def _wna16_rank(rank: int, paths: dict):
    out = {}
    for name, path in paths.items():
        try:
            out[name] = run_schedule(build_runner(ModelSource(name, path)), prompt_seed=5, decode=True)
        except ValueError as e:
            out[name] = str(e)
    return out


def test_weight_only_int4_checkpoints_over_two_ranks(tmp_path):
    """Packed int4 weights, group scales and zero points cut along the output (column-parallel: the
    packed words of GPTQ/AWQ zero points hold 8 output features) and along the input (row-parallel:
    the rank's groups). Weight-only layers compute in float, so TP=2 matches TP=1 in fp32. GPTQ
    act-order, whose groups cross the ranks' input parts, is a clear error."""
    from tests.wna16_reference import make_gptq_or_awq, make_pack_quantized
    tokenizer = load_tokenizer(None)
    paths = {"gptq": make_gptq_or_awq(tmp_path / "gptq", tokenizer, "gptq", 4, 64)[0],
             "awq": make_gptq_or_awq(tmp_path / "awq", tokenizer, "awq", 4, 64, symmetric=False, seed=1)[0],
             "ct": make_pack_quantized(tmp_path / "ct", tokenizer, 4, 64, symmetric=False, seed=2)[0],
             "gptq-act-order": make_gptq_or_awq(tmp_path / "act", tokenizer, "gptq", 4, 64, desc_act=True, seed=3)[0]}
    ranks = run_ranks(_wna16_rank, 2, 1, paths)
    for name in ("gptq", "awq", "ct"):
        want = run_schedule(build_runner(ModelSource(name, paths[name])), prompt_seed=5, decode=True)
        for got in ranks:
            assert_same_steps(got[name], want)
    assert "quantization groups of other ranks" in ranks[0]["gptq-act-order"]
