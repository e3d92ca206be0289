"""FusedMoE (layers/moe/layer.py) vs transformers' MixtralSparseMoeBlock and Qwen2MoeSparseMoeBlock.

A one-layer model of each family with random weights is saved by transformers (save_pretrained
writes the original checkpoint names: block_sparse_moe.experts.{e}.w1/w2/w3, mlp.experts.{e}.
gate_proj/..., mlp.shared_expert*), the layer-0 MoE tensors of that file are loaded by name into
FusedMoE, and both blocks run on the same random tokens in fp32. The routed experts run through the
op's CPU path (the torch reference) and, in a second case, through the Triton kernels (in the
interpreter without CUDA).
"""
import pytest
import torch
from safetensors.torch import load_file

from tests import triton_interpreter_shims

triton_interpreter_shims.install()

from splitserve.kernels.moe import fused_moe as FM  # noqa: E402
from splitserve.layers.moe.layer import FusedMoE, checkpoint_target  # noqa: E402

LAYER = "model.layers.0."


def randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def saved_layer_tensors(model, tmp_path) -> dict[str, torch.Tensor]:
    model.save_pretrained(tmp_path)
    return {name[len(LAYER):]: t for name, t in load_file(tmp_path / "model.safetensors").items()
            if name.startswith(LAYER)}


def mixtral(top_k=2, experts=8):
    from transformers import MixtralConfig, MixtralForCausalLM
    cfg = MixtralConfig(vocab_size=32, hidden_size=24, intermediate_size=40, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=experts,
                        num_experts_per_tok=top_k)
    model = MixtralForCausalLM(cfg).float().eval()
    ours = FusedMoE(experts, top_k, 24, 40, renormalize=True, params_dtype=torch.float32)
    return model, ours


def qwen2_moe(norm_topk_prob):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    cfg = Qwen2MoeConfig(vocab_size=32, hidden_size=24, intermediate_size=56, moe_intermediate_size=20,
                         shared_expert_intermediate_size=36, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, num_experts=6, num_experts_per_tok=4,
                         norm_topk_prob=norm_topk_prob)
    model = Qwen2MoeForCausalLM(cfg).float().eval()
    ours = FusedMoE(6, 4, 24, 20, renormalize=norm_topk_prob, shared_expert_intermediate_size=36,
                    params_dtype=torch.float32)
    return model, ours


CASES = {
    "mixtral-8-top2": lambda: mixtral(),
    "mixtral-4-top1": lambda: mixtral(top_k=1, experts=4),
    "qwen2moe-norm": lambda: qwen2_moe(True),
    "qwen2moe-raw": lambda: qwen2_moe(False),
}


@pytest.mark.parametrize("kernel", ["reference", "triton"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_moe_matches_transformers(case, kernel, tmp_path, monkeypatch):
    model, ours = CASES[case]()
    randomize(model, seed=sum(map(ord, case)))
    tensors = saved_layer_tensors(model, tmp_path)
    moe_names = [n for n in tensors if checkpoint_target(n) is not None]
    # everything of the layer that is not attention or a norm is the MoE block's
    assert sorted(moe_names) == sorted(n for n in tensors if not n.startswith(("self_attn.", "input_layernorm.",
                                                                             "post_attention_layernorm.")))
    for name in moe_names:
        ours.load_checkpoint_tensor(name, tensors[name])
    assert ours.missing_weights() == []
    if kernel == "triton":
        monkeypatch.setattr(FM, "fused_moe", FM.fused_moe_triton)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 9, 24, generator=g)
    layer = model.model.layers[0]
    block = layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe  # transformers 5 / 4 spelling
    with torch.no_grad():
        expected = block(x)
        expected = expected[0] if isinstance(expected, tuple) else expected  # 4.x also returns router logits
        out = ours(x)
    assert out.shape == x.shape
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_loader_names_and_errors():
    assert checkpoint_target("block_sparse_moe.experts.7.w3.weight") == ("w13", 7, "up")
    assert checkpoint_target("mlp.experts.0.down_proj.weight") == ("w2", 0, None)
    assert checkpoint_target("mlp.shared_expert.up_proj.weight") == ("shared_w13", None, "up")
    assert checkpoint_target("mlp.shared_expert_gate.weight") == ("shared_gate", None, None)
    assert checkpoint_target("mlp.gate_proj.weight") is None  # a dense MLP's
    moe = FusedMoE(4, 2, 8, 6, params_dtype=torch.float32)
    with pytest.raises(ValueError, match="out of range"):
        moe.load("w13", torch.zeros(6, 8), expert_id=4, shard="gate")
    with pytest.raises(ValueError, match="checkpoint shape"):
        moe.load("w2", torch.zeros(6, 8), expert_id=0)
    with pytest.raises(ValueError, match="no parameter"):
        moe.load("shared_w2", torch.zeros(8, 6))
    with pytest.raises(ValueError, match="not a mixture-of-experts"):
        moe.load_checkpoint_tensor("mlp.down_proj.weight", torch.zeros(8, 6))
    moe.load("w13", torch.ones(4, 12, 8))  # all experts at once (transformers >= 5 layout)
    moe.load("w2", torch.ones(6 * 0 + 8, 6), expert_id=1)
    assert "w2[0]" in moe.missing_weights() and "w2[1]" not in moe.missing_weights()
    assert not any(m.startswith("w13") for m in moe.missing_weights()) and "router" in moe.missing_weights()


def test_fused_moe_traces_in_a_compiled_region():
    # the op's fake implementation lets Dynamo trace the whole layer (router, op, shared expert)
    # with a dynamic token count and no graph break
    moe = FusedMoE(4, 2, 16, 12, renormalize=False, shared_expert_intermediate_size=8, params_dtype=torch.float32)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    compiled = torch.compile(moe, backend="aot_eager", fullgraph=True, dynamic=True)
    for T in (3, 10):
        x = torch.randn(T, 16, generator=g)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), moe(x))
