"""The family table: configs read into the decoder's choices, and every config field the decoder
cannot compute refused by name (never ignored)."""
import pytest
import torch
from transformers import CONFIG_MAPPING

from splitserve.models.decoder import DecoderForCausalLM
from splitserve.loading.architectures import ARCHITECTURES
from splitserve.models.families import FAMILIES, decoder_spec
from splitserve.models.registry import get_model_class

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=64)


def config(model_type: str, **kw):
    return CONFIG_MAPPING[model_type](**{**TINY, **kw})


def test_every_family_is_registered():
    assert set(ARCHITECTURES) == set(FAMILIES)
    for model_type, arch in ARCHITECTURES.items():
        assert get_model_class([arch])[1] is DecoderForCausalLM


@pytest.mark.parametrize("model_type,kw,field", [
    ("stablelm", dict(use_parallel_residual=True), "use_parallel_residual"),
    ("opt", dict(do_layer_norm_before=False, ffn_dim=64), "do_layer_norm_before"),
    ("opt", dict(word_embed_proj_dim=16, ffn_dim=64), "word_embed_proj_dim"),
    ("opt", dict(_remove_final_layer_norm=True, ffn_dim=64), "_remove_final_layer_norm"),
    ("llama", dict(attn_logit_softcapping=30.0), "attn_logit_softcapping"),
    ("llama", dict(qk_layernorm=True), "qk_layernorm"),
    ("llama", dict(residual_multiplier=0.5), "residual_multiplier"),
    ("mistral", dict(query_pre_attn_scalar=32), "query_pre_attn_scalar"),
    ("qwen2", dict(num_experts=8), "num_experts"),
    ("llama", dict(layer_types=["chunked_attention", "full_attention"]), "layer_types"),
    ("gemma2", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
])
def test_unimplemented_fields_are_refused_by_name(model_type, kw, field):
    cfg = config(model_type)
    for key, value in kw.items():  # set after construction: some classes reject or rewrite them
        setattr(cfg, key, value)
    with pytest.raises(ValueError, match=field):
        decoder_spec(cfg)


def test_unknown_family_activation_and_rope_are_refused():
    cfg = config("llama")
    cfg.model_type = "gpt_neox"
    with pytest.raises(ValueError, match="model_type 'gpt_neox' is not supported"):
        decoder_spec(cfg)
    with pytest.raises(ValueError, match="activation 'quick_gelu' is not supported"):
        DecoderForCausalLM(config("llama", hidden_act="quick_gelu"))
    cfg = config("llama")
    cfg.rope_parameters = {"rope_type": "mrope", "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="rope type 'mrope'"):
        DecoderForCausalLM(cfg)


def test_spec_reads_each_family_choice():
    gemma = decoder_spec(config("gemma2", head_dim=16, query_pre_attn_scalar=25, attn_logit_softcapping=50.0,
                                final_logit_softcapping=30.0, sliding_window=8))
    assert (gemma.scale, gemma.attn_soft_cap, gemma.final_soft_cap) == (0.2, 50.0, 30.0)
    assert gemma.windows == (8, None) and gemma.activation == "gelu_pytorch_tanh" and gemma.embed_scale == 32 ** 0.5
    assert gemma.attn_variants == ((None, 50.0), (8, 50.0))
    granite = decoder_spec(config("granite", attention_multiplier=0.1, residual_multiplier=0.5, logits_scaling=4.0,
                                  embedding_multiplier=12.0))
    assert (granite.scale, granite.residual_multiplier, granite.logits_scaling, granite.embedding_multiplier) == \
        (0.1, 0.5, 4.0, 12.0)
    llama = decoder_spec(config("llama"))
    assert (llama.residual_multiplier, llama.logits_scaling, llama.embed_scale, llama.attn_soft_cap) == (None,) * 4
    assert llama.rot_dim == 16 and not llama.qkv_bias
    assert decoder_spec(config("qwen2")).qkv_bias and not decoder_spec(config("qwen2")).o_bias
    stablelm = decoder_spec(config("stablelm", qk_layernorm=True))
    assert stablelm.qk_norm == "layer_per_head" and stablelm.rot_dim == 4  # partial_rotary_factor 0.25
    assert decoder_spec(config("stablelm")).qk_norm is None
    opt = decoder_spec(config("opt", ffn_dim=48))
    assert opt.rope is None and opt.rot_dim == 0 and opt.intermediate_size == 48 and opt.activation == "relu"
    moe = decoder_spec(config("qwen2_moe", num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
                              moe_intermediate_size=8, shared_expert_intermediate_size=16)).moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.shared_intermediate_size) == (4, 2, 8, 16)
    assert moe.dense_layers == {1} and not moe.renormalize
    assert decoder_spec(config("mixtral", num_local_experts=4)).moe.renormalize


def test_llama_layer_holds_no_other_family_choice():
    """A Llama layer has none of the optional modules, so its halves run the ops they always ran."""
    model = DecoderForCausalLM(config("llama"))
    layer = model.layers[0]
    assert layer.self_attn.q_norm is None and not layer.sandwich and layer.residual_multiplier is None
    assert model.embed_scale is None and model.embedding_multiplier is None and model.embed_positions is None
    assert not hasattr(layer, "pre_feedforward_layernorm")


def test_checkpoint_names_for_quantization():
    """A quantization config names checkpoint modules: each decoder linear knows the ones it stands for."""
    assert FAMILIES["llama"].names.checkpoint_modules("self_attn.qkv_proj") == \
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    assert FAMILIES["phi3"].names.checkpoint_modules("self_attn.qkv_proj") == ("self_attn.qkv_proj",)
    assert FAMILIES["opt"].names.checkpoint_modules("mlp.up_proj") == ("fc1",)
    assert FAMILIES["opt"].names.checkpoint_modules("self_attn.o_proj") == ("self_attn.out_proj",)
    assert FAMILIES["llama"].names.checkpoint_modules("mlp.down_proj") == ("mlp.down_proj",)


def test_tied_embedding_families_and_moe_tensor_parallel_refusal(monkeypatch):
    from splitserve.parallel import parallel_state
    model = DecoderForCausalLM(config("gemma2", head_dim=16))
    assert model.lm_head is None  # tied
    monkeypatch.setattr(parallel_state, "_TP", parallel_state.ParallelGroup(rank=0, world_size=2))
    with pytest.raises(ValueError, match="tensor parallelism is not supported for mixture-of-experts"):
        DecoderForCausalLM(config("mixtral", num_local_experts=4, num_key_value_heads=2))


def test_learned_positions_and_embedding_scale():
    torch.manual_seed(0)
    model = DecoderForCausalLM(config("opt", ffn_dim=64))
    for p in model.parameters():
        p.data.normal_()
    ids, pos = torch.tensor([3, 4]), torch.tensor([0, 5])
    x, residual = model.start(model.embed(ids), pos)
    torch.testing.assert_close(x, model.embed_tokens.weight[ids] + model.embed_positions.weight[pos + 2])
    assert torch.all(residual == 0)
