"""Quantized checkpoints written offline by compressed-tensors (the library llm-compressor saves
with), and the same weights re-spelled in the other formats splitserve reads.

Scales are computed here the way llm-compressor's min-max observers do (absmax / half range per
tensor, channel or block); static activation scales come from running calibration prompts through
the float model first. transformers then loads the compressed-tensors checkpoint itself (it
decompresses the weights and fake-quantizes the activations with compressed-tensors' own code),
which is the independent reference the tests compare with.
"""
from __future__ import annotations

import json
import os
import shutil

import torch

FP8_MAX = 448.0


def _half_range(args) -> float:
    return FP8_MAX if args.type == "float" else 127.5


def _weight_scale(w: torch.Tensor, args) -> torch.Tensor:
    w = w.abs().float()
    if args.strategy == "tensor":
        amax = w.amax().reshape(1)
    elif args.strategy == "channel":
        amax = w.amax(dim=1, keepdim=True)
    elif args.strategy == "block":
        bn, bk = args.block_structure
        amax = w.reshape(w.shape[0] // bn, bn, w.shape[1] // bk, bk).amax(dim=(1, 3))
    else:
        raise ValueError(args.strategy)
    return amax / _half_range(args)


@torch.no_grad()
def input_absmax(model, calibration: list[list[int]]) -> dict[str, float]:
    """The largest |input| each nn.Linear sees over the calibration prompts (float model)."""
    seen: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            def hook(mod, args, name=name):
                seen[name] = max(seen.get(name, 0.0), args[0].abs().max().item())
            hooks.append(module.register_forward_pre_hook(hook))
    for ids in calibration:
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return seen


@torch.no_grad()
def quantize_hf_model(model, preset: str, calibration: list[list[int]], ignore=("lm_head",)):
    """Applies a compressed-tensors preset scheme to every Linear but `ignore`, with calibrated
    scales; the model then fake-quantizes in its forward (compressed-tensors' QDQ)."""
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    amax = input_absmax(model, calibration)
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
                                ignore=list(ignore))
    apply_quantization_config(model, config)
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        module.weight_scale.data.copy_(_weight_scale(module.weight.data, scheme.weights))
        act = scheme.input_activations
        if act is not None and not act.dynamic:
            module.input_scale.data.fill_(amax[name] / _half_range(act))
    return model


def save_compressed(model, path: str, tokenizer=None) -> str:
    """Compresses a quantize_hf_model() model (FP8 / int8 storage) and saves it with its config."""
    from compressed_tensors.compressors import ModelCompressor
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return str(path)


def make_compressed_llama_dir(path, tokenizer, preset: str, calibration: list[list[int]], seed: int = 0,
                              **overrides) -> str:
    """A tiny random Llama quantized with a compressed-tensors preset (FP8, FP8_DYNAMIC, FP8_BLOCK,
    W8A8, ...). Sizes are multiples of 128 so 128x128 blocks fit every shard."""
    from transformers import LlamaConfig, LlamaForCausalLM
    kw = dict(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
              initializer_range=0.05, rms_norm_eps=1e-6, bos_token_id=tokenizer.bos_token_id,
              eos_token_id=tokenizer.eos_token_id)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    quantize_hf_model(model, preset, calibration)
    return save_compressed(model, path, tokenizer)


def _rewrite(src: str, dst: str, rename, config_update) -> str:
    """Copies a checkpoint directory, renaming / reshaping tensors and editing config.json."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    for name in os.listdir(dst):
        if name.endswith(".safetensors"):
            path = os.path.join(dst, name)
            tensors = load_file(path)
            out = {}
            for key, value in tensors.items():
                for new_key, new_value in rename(key, value):
                    out[new_key] = new_value.contiguous()
            save_file(out, path, metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    config_update(cfg, dst)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return dst


def to_deepseek_fp8(ct_dir: str, dst: str) -> str:
    """A compressed-tensors FP8_BLOCK checkpoint re-spelled as `quant_method: fp8` with
    `weight_block_size` and `weight_scale_inv` (the DeepSeek-V3 / transformers FineGrainedFP8 layout)."""
    def rename(key, value):
        yield (key.replace(".weight_scale", ".weight_scale_inv") if key.endswith(".weight_scale") else key), value

    def update(cfg, _):
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                      "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
    return _rewrite(ct_dir, dst, rename, update)


def to_modelopt_fp8(ct_dir: str, dst: str, kv_scales: bool = True) -> str:
    """A compressed-tensors FP8 (static per-tensor) checkpoint re-spelled as an NVIDIA ModelOpt export:
    scalar `weight_scale` / `input_scale`, `hf_quant_config.json` beside the weights, and (as
    ModelOpt writes with an FP8 KV cache) `k_scale` / `v_scale` on k_proj / v_proj."""
    def rename(key, value):
        if key.endswith("_scale"):
            value = value.reshape(())
        yield key, value
        if kv_scales and key.endswith(("k_proj.weight", "v_proj.weight")):
            yield key.replace(".weight", ".k_scale" if "k_proj" in key else ".v_scale"), torch.tensor(1.0)

    def update(cfg, directory):
        cfg.pop("quantization_config")
        with open(os.path.join(directory, "hf_quant_config.json"), "w") as f:
            json.dump({"producer": {"name": "modelopt", "version": "0.19.0"},
                       "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8" if kv_scales else None,
                                        "exclude_modules": ["lm_head"]}}, f)
    return _rewrite(ct_dir, dst, rename, update)


@torch.no_grad()
def hf_greedy_logprobs(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the full log-softmax of every step ([steps, vocab])."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         output_scores=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    return tokens, torch.stack([torch.log_softmax(s[0].float(), -1) for s in out.scores])


def compare_greedy(got_tokens: list[int], got_logprobs: list[float], ref_tokens: list[int], ref_lp: torch.Tensor,
                   tol: float) -> bool:
    """Quantized models amplify rounding: an activation a float32 ulp away lands in the next FP8 or
    INT8 step. So: logprobs within `tol` up to the first differing token, and a differing token
    only where the reference itself nearly tied (its logprob within `tol` of the reference's
    choice). Returns whether the whole sequence agreed."""
    for i, (g, r) in enumerate(zip(got_tokens, ref_tokens)):
        if g != r:
            margin = (ref_lp[i, r] - ref_lp[i, g]).item()
            assert margin < tol, f"step {i}: token {g} instead of {r}, whose reference margin is {margin:.4f}"
            return False
        assert abs(got_logprobs[i] - ref_lp[i, r].item()) < tol, \
            f"step {i}: logprob {got_logprobs[i]:.5f} vs reference {ref_lp[i, r].item():.5f}"
    return True


def random_quantized_weights(module: torch.nn.Module, gen: torch.Generator, std: float = 0.1) -> None:
    """Random weights for a module built with a quantization config: N(0, std) for its float
    parameters, each quantized layer's own storage from its method's init_random, then the
    post-load processing the loader would run."""
    from splitserve.layers.linear import process_weights_after_loading
    for p in module.parameters():
        if p.dtype.is_floating_point and p.element_size() >= 2:
            p.data.normal_(0, std, generator=gen)
    for m in module.modules():
        if getattr(m, "is_quantized", False):
            m.method.init_random(m, gen)
    process_weights_after_loading(module)
