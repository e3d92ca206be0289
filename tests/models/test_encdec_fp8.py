"""`--quantization fp8` (online: per-channel FP8 weights, dynamic per-token activations) on the
encoder-decoder models, against transformers on the same tiny random weights with compressed-tensors'
FP8_DYNAMIC fake quantization of the same layers (the same format, implemented independently;
tests/quant_reference.py): T5 (both of its shapes: Flan-T5's gated-GELU with its own head, T5 v1.0's
ReLU with the head tied to the scaled embedding) and Pix2Struct (the text decoder quantized, the
vision encoder and the heads float, as the online config and the engine's vision towers say).

How parity is judged: as for the FP8 decoders (tests/models/test_quantized_vlm.py), by
`compare_greedy` at tol 0.1. Two exact FP8 implementations do not agree to float32 precision: an
activation one float32 ulp away lands in the neighbouring FP8 step and the change spreads through
the layers, so logprobs agree to about FP8's own noise and a differing greedy token is allowed only
where the reference itself nearly tied. A wrong scale, layout or unquantized layer is far outside
that (the float model differs from the reference by more than the bound checked below); the layers
are also checked to hold float8_e4m3fn weights, so a model that silently stayed float fails."""
import copy
import random

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.loading.resolve import load_tokenizer
from tests.quant_reference import compare_greedy, quantize_hf_model

NEW_TOKENS = 8
FP8 = torch.float8_e4m3fn
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)


@torch.inference_mode()
def hf_greedy_lp(model, inputs: dict) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens (after the decoder start) and every step's full log-softmax."""
    out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, 1:].tolist(), torch.stack([torch.log_softmax(s[0].float(), -1) for s in out.logits])


def check(outs, refs, floats) -> None:
    """Every request within compare_greedy's bound of the FP8 reference, most of them whole; and
    somewhere farther than that bound's tenth from the float model (it really quantized)."""
    whole, far = 0, 0.0
    for out, (ref_tokens, ref_lp), (_, float_lp) in zip(outs, refs, floats, strict=True):
        got = out.outputs[0]
        got_lp = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
        whole += compare_greedy(got.token_ids, got_lp, ref_tokens, ref_lp, tol=0.1)
        n = next((i for i, (a, b) in enumerate(zip(got.token_ids, ref_tokens)) if a != b), len(ref_tokens))
        far = max([far, *(abs(got_lp[i] - float_lp[i, got.token_ids[i]].item()) for i in range(n))])
    assert whole >= len(outs) - 1
    assert far > 0.01, "the FP8 model gives the float model's logprobs: nothing was quantized"


# -- T5 ------------------------------------------------------------------------------------------------
CASES = {"flan-t5": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False),
         "t5-v1.0": dict(feed_forward_proj="relu", tie_word_embeddings=True)}


@pytest.mark.parametrize("case", list(CASES))
def test_t5_online_fp8_matches_fp8_reference(case, tmp_path):
    from transformers import T5ForConditionalGeneration
    from tests.t5_reference import make_tiny_t5
    tok = load_tokenizer(None)
    path = make_tiny_t5(tmp_path / case, tok, seed=11, **CASES[case])
    hf = T5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    ref = quantize_hf_model(copy.deepcopy(hf), "FP8_DYNAMIC", [], ignore=["lm_head"])
    rng = random.Random(3)
    prompts = [[rng.randrange(3, len(tok)) for _ in range(n)] for n in (5, 23, 14, 40)]

    llm = LLM(path, quantization="fp8", num_blocks=64, block_size=8, max_num_batched_tokens=96,
              attention_backend="torch_ref")
    model = llm.engine.runner.model
    for stack in (model.encoder, model.decoder):
        for block in stack.block:
            for sub in block.layer:
                body = getattr(sub, "SelfAttention", None) or getattr(sub, "EncDecAttention", None)
                layers = ([body.o_proj, getattr(body, "qkv_proj", None) or body.q_proj] if body is not None
                          else [sub.DenseReluDense.wi, sub.DenseReluDense.wo])
                for layer in layers:
                    assert layer.weight.dtype == FP8 and layer.weight_scale.shape == (layer.out_features,)
    assert model.decoder.block[0].layer[1].EncDecAttention.kv_proj.weight.dtype == FP8
    # the embedding stays float, and with it the head (transformers 5 saves every T5 tied)
    assert model.shared.weight.dtype == torch.float32 and model.lm_head is None

    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    inputs = [{"input_ids": torch.tensor([p]), "attention_mask": torch.ones(1, len(p), dtype=torch.long)}
              for p in prompts]
    check(outs, [hf_greedy_lp(ref, i) for i in inputs], [hf_greedy_lp(hf, i) for i in inputs])
    assert llm.engine.kv_manager.pool.is_whole()


# -- Pix2Struct ----------------------------------------------------------------------------------------
def test_pix2struct_online_fp8_matches_fp8_reference(tmp_path):
    from splitserve.models.pix2struct.processor import DEPLOT_PROMPT
    from tests.pix2struct_reference import bar_chart, hf_inputs, make_tiny_deplot
    path, hf, processor = make_tiny_deplot(tmp_path / "deplot")
    # the text decoder's linears; the vision encoder ("encoder.*") and the head stay float
    ref = quantize_hf_model(copy.deepcopy(hf), "FP8_DYNAMIC", [], ignore=["decoder.lm_head", r"re:^encoder\..*"])
    assert ref.decoder.layer[0].self_attention.attention.query.quantization_scheme is not None
    assert getattr(ref.encoder.encoder.layer[0].attention.query, "quantization_scheme", None) is None
    cases = [(bar_chart([0.3, 0.9, 0.5], (120, 80)), DEPLOT_PROMPT),
             (bar_chart([0.7, 0.2, 0.4, 0.8, 0.6], (64, 128), seed=1), DEPLOT_PROMPT),
             (bar_chart([0.5, 0.5], (200, 60), seed=2), "What is the value of bar B?")]

    llm = LLM(path, quantization="fp8", num_blocks=128, block_size=8, max_num_batched_tokens=256,
              attention_backend="torch_ref")
    model = llm.engine.runner.model
    for block in model.decoder.layer:
        for layer in (block.self_attention.attention.qkv_proj, block.self_attention.attention.o_proj,
                      block.encoder_decoder_attention.attention.q_proj,
                      block.encoder_decoder_attention.attention.kv_proj, block.mlp.DenseReluDense.wi,
                      block.mlp.DenseReluDense.wo):
            assert layer.weight.dtype == FP8
    vision = model.encoder.encoder.layer[0]
    assert not vision.attention.qkv_proj.is_quantized and vision.attention.qkv_proj.weight.dtype == torch.float32
    assert not model.decoder.lm_head.is_quantized

    outs = llm.generate([{"prompt": h, "multi_modal_data": {"image": img}} for img, h in cases], PARAMS,
                        use_tqdm=False)
    inputs = [dict(hf_inputs(processor, img, h)) for img, h in cases]
    check(outs, [hf_greedy_lp(ref, i) for i in inputs], [hf_greedy_lp(hf, i) for i in inputs])
    assert llm.engine.kv_manager.pool.is_whole()
