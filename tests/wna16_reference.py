"""W4A16 / W8A16 checkpoints of tiny random Llamas, written offline for the tests.

GPTQ and AWQ tensors are packed here, by code of the tests' own that follows the formats as their
packers document them (AutoGPTQ's `pack`, AutoAWQ's GEMM `WQLinear_GEMM.from_linear`), not by
splitserve's converters. The reference model is transformers' Llama with every quantized weight
replaced by its dequantized value (float32). compressed-tensors checkpoints are written by
compressed-tensors' own compressors, and transformers decompresses them itself.
"""
from __future__ import annotations

import json
import os

import torch

from tests.quant_reference import save_compressed

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of a word holds column 8 * word + ORDER[i]
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_llama(tokenizer, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, initializer_range=0.05, rms_norm_eps=1e-6,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return LlamaForCausalLM(cfg).eval()


def group_quantize(w: torch.Tensor, bits: int, g_idx: torch.Tensor, symmetric: bool):
    """Min-max quantization of w [N, K] with input channel k in group g_idx[k]. Returns unsigned q
    [N, K], scale [groups, N] (rounded to fp16, as the formats store it), zero [groups, N] (unsigned),
    and the dequantized weight."""
    n, k = w.shape
    groups = int(g_idx.max()) + 1
    qmax = 2 ** bits - 1
    scale = torch.empty(groups, n)
    zero = torch.empty(groups, n)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if symmetric:
            scale[g] = cols.abs().amax(1).clamp(min=1e-6) * 2 / qmax
            zero[g] = 2 ** (bits - 1)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            scale[g] = ((hi - lo) / qmax).clamp(min=1e-6)
            zero[g] = torch.round(-lo / scale[g].half().float()).clamp(0, qmax)
    scale = scale.half().float()
    s_k, z_k = scale[g_idx.long()].t(), zero[g_idx.long()].t()  # [N, K]
    q = torch.clamp(torch.round(w / s_k) + z_k, 0, qmax)
    return q.to(torch.int64), scale, zero.to(torch.int64), (q - z_k) * s_k


def pack_rows(v: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] -> int32 [R * bits / 32, C]: word i holds rows (32/bits)*i + j at bit bits*j."""
    per = 32 // bits
    out = torch.zeros(v.shape[0] // per, v.shape[1], dtype=torch.int64)
    for j in range(per):
        out |= v[j::per] << (bits * j)
    return torch.where(out >= 2 ** 31, out - 2 ** 32, out).to(torch.int32)


def pack_awq(v: torch.Tensor) -> torch.Tensor:
    """[R, C] 4-bit -> int32 [R, C / 8] in AutoAWQ's column order."""
    out = torch.zeros(v.shape[0], v.shape[1] // 8, dtype=torch.int64)
    for i, col in enumerate(AWQ_PACK_ORDER):
        out |= v[:, col::8] << (4 * i)
    return torch.where(out >= 2 ** 31, out - 2 ** 32, out).to(torch.int32)


def act_order_g_idx(k: int, group: int, gen: torch.Generator) -> torch.Tensor:
    """A desc_act-style g_idx: groups of `group` channels taken in a random channel order."""
    order = torch.randperm(k, generator=gen)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group).to(torch.int32)
    return g_idx


def _write(model, path, tensors: dict, quantization_config: dict, tokenizer) -> str:
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    model.config.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = quantization_config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    tokenizer.save_pretrained(path)
    return str(path)


@torch.no_grad()
def make_gptq_or_awq(path, tokenizer, fmt: str, bits: int, group: int, symmetric: bool = True,
                     desc_act: bool = False, checkpoint_format: str = "gptq", seed: int = 0, tamper=None):
    """Writes a `gptq` or `awq` checkpoint; returns (path, reference model with dequantized weights).
    `tamper(name, tensor)` may replace a tensor before saving (error tests)."""
    model = tiny_llama(tokenizer, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    tensors = {}
    # desc_act orders input channels by the Hessian of the layer's input, so projections of the same
    # input (q/k/v, gate/up) share one g_idx
    shared_g_idx: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if not (name.endswith(".weight") and module.rsplit(".", 1)[-1] in QUANTIZED):
            tensors[name] = t.clone()
            continue
        w = t.float()
        n, k = w.shape
        same_input = module.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
        if desc_act:
            g_idx = shared_g_idx.setdefault(same_input, act_order_g_idx(k, group, gen))
        else:
            g_idx = (torch.arange(k) // group).to(torch.int32)
        q, scale, zero, dequant = group_quantize(w, bits, g_idx, symmetric)
        t.copy_(dequant)  # the reference model runs exactly these weights
        if fmt == "gptq":
            stored_zero = zero - 1 if checkpoint_format == "gptq" else zero  # v1 stores zero - 1
            tensors[f"{module}.qweight"] = pack_rows(q.t(), bits)
            tensors[f"{module}.qzeros"] = pack_rows((stored_zero & (2 ** bits - 1)).t(), bits).t()
            tensors[f"{module}.scales"] = scale.half()
            tensors[f"{module}.g_idx"] = g_idx.clone()
        else:
            tensors[f"{module}.qweight"] = pack_awq(q.t())
            tensors[f"{module}.qzeros"] = pack_awq(zero)
            tensors[f"{module}.scales"] = scale.half()
    if tamper is not None:
        tensors = dict(tamper(k, v) for k, v in tensors.items())
    if fmt == "gptq":
        qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": symmetric,
              "checkpoint_format": checkpoint_format, "lm_head": False}
    else:
        qc = {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}
    return _write(model, path, tensors, qc, tokenizer), model


@torch.no_grad()
def make_pack_quantized(path, tokenizer, bits: int, group: int, symmetric: bool, seed: int = 0):
    """A compressed-tensors pack-quantized checkpoint (W4A16 / W8A16, group `group` or -1 for
    channel), min-max scales from the tests' group_quantize, compressed by compressed-tensors.
    Returns (path, reference): the reference model runs the weights compressed-tensors' own
    fake_quantize makes (transformers 5 cannot load packed asymmetric zero points back)."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    model = tiny_llama(tokenizer, seed)
    strategy = "channel" if group == -1 else "group"
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy,
                            group_size=None if group == -1 else group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    half = 2 ** (bits - 1)
    dequantized = {}
    for _, module in model.named_modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        w = module.weight.data.float()
        k = w.shape[1]
        g_idx = torch.zeros(k, dtype=torch.int32) if group == -1 else (torch.arange(k) // group).to(torch.int32)
        _, scale, zero, _ = group_quantize(w, bits, g_idx, symmetric)
        module.weight_scale.data.copy_(scale.t().reshape(module.weight_scale.shape))
        if not symmetric:  # compressed-tensors stores signed zero points
            module.weight_zero_point.data.copy_((zero - half).t().reshape(module.weight_zero_point.shape))
        dequantized[module] = fake_quantize(w, module.weight_scale.data.float(), module.weight_zero_point.data, args)
    reference = tiny_llama(tokenizer, seed)
    ref_modules = dict(reference.named_modules())
    for name, module in model.named_modules():
        if module in dequantized:
            ref_modules[name].weight.data.copy_(dequantized[module])
    return save_compressed(model, path, tokenizer), reference
