"""Tiny random T5 checkpoints and transformers' greedy reference for the encoder-decoder tests."""
import pytest
import torch


def make_tiny_t5(path, tokenizer, seed: int, **overrides) -> str:
    from transformers import T5Config, T5ForConditionalGeneration
    config = T5Config(vocab_size=len(tokenizer), d_model=64, d_kv=8, d_ff=96, num_layers=3, num_decoder_layers=2,
                      num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=20,
                      dropout_rate=0.0, initializer_factor=1.0, decoder_start_token_id=0, pad_token_id=0,
                      eos_token_id=tokenizer.eos_token_id, **overrides)
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(config).eval()
    with torch.no_grad():  # norms start as ones: make them matter too
        for name, param in model.named_parameters():
            if "layer_norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@torch.inference_mode()
def hf_t5_greedy(model, encoder_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    ids = torch.tensor([encoder_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         min_new_tokens=max_new_tokens, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, 1:].tolist()  # after the decoder start token
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, tokens)]
    return tokens, logprobs


def assert_like_hf(hf, prompts, outs, max_new_tokens: int, atol: float = 2e-4):
    spread = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        ref_tokens, ref_logprobs = hf_t5_greedy(hf, prompt, max_new_tokens)
        comp = out.outputs[0]
        assert comp.token_ids == ref_tokens, f"encoder length {len(prompt)}"
        got = [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)]
        assert got == pytest.approx(ref_logprobs, abs=atol)
        spread = max([spread, *map(abs, ref_logprobs)])
    assert spread > 1e-2, "saturated logits would make the logprob check vacuous"
