"""Weight-only int4 / int8 linear layers (W4A16, W8A16): GPTQ, AWQ (GEMM) and compressed-tensors
`pack-quantized` checkpoints, and the `gptq` / `awq` quantization configs.

The method's parameters are the checkpoint's own tensors, declared with ParamLayouts so the generic
loader cuts merged shards (QKV, gate/up) out of them:

    gptq   qweight int32 [K/P, N]   qzeros int32 [K/G, N/P]   scales [K/G, N]   g_idx [K] (shared)
    awq    qweight int32 [K, N/8]   qzeros int32 [K/G, N/8]   scales [K/G, N]
    ct     weight_packed int32 [N, K/P]   weight_scale [N, K/G]   weight_zero_point int32 [N/P, K/G]
           (asymmetric)   weight_g_idx [K] (actorder "group")   weight_shape (checked, not stored)

After loading they are converted once into the one canonical layout (kernels/gemm/wna16/wna16_layout.py)
and replaced by `qweight`, `scales`, optional `zeros` and `perm`. On CUDA `apply` runs
`kernels.gemm.wna16_linear` (split-K Triton kernel for few tokens, dequantize + cuBLAS for many)
as the custom op `splitserve::wna16_linear`, opaque to torch.compile; elsewhere the torch reference
(dequantize, matmul in float32).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from splitserve.kernels.gemm.wna16.wna16_gemm import wna16_linear, wna16_route
from splitserve.kernels.gemm.wna16.wna16_layout import (WNA16Weight, from_awq, from_compressed_tensors, from_gptq,
                                                          quantize_rtn)
from splitserve.kernels.ops import wna16_linear_op
from splitserve.layers.quantization.base import (UNQUANTIZED, LinearMethod, ParamLayout, QuantConfig, register_param,
                                                 replace_param, same_method)

FORMATS = ("gptq", "awq", "ct")
_LOADED_PARAMS = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "ct": ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx"),
}


@dataclass(frozen=True)
class WNA16Scheme:
    fmt: str                 # "gptq" | "awq" | "ct" (compressed-tensors pack-quantized)
    bits: int
    group_size: int          # -1: one group per output channel
    symmetric: bool = True   # ct: asymmetric checkpoints carry weight_zero_point; gptq: `sym`, for random
                             # weights (a checkpoint's zero points decide when loading)
    act_order: bool = False  # ct only: weight_g_idx is stored (gptq always stores g_idx)
    checkpoint_format: str = "gptq"  # gptq only: "gptq" (v1, zeros minus one) or "gptq_v2"

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown WNA16 format {self.fmt!r}")
        if self.bits not in (4, 8) or (self.fmt == "awq" and self.bits != 4):
            raise ValueError(f"{self.fmt}: {self.bits}-bit weights are not supported (4 or 8; AWQ: 4)")
        if self.group_size != -1 and (self.group_size <= 0 or self.group_size % 16):
            raise ValueError(f"{self.fmt}: group size {self.group_size} is not supported (-1 or a multiple of 16)")
        if self.checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq: unknown checkpoint_format {self.checkpoint_format!r} (gptq or gptq_v2)")

    def describe(self) -> str:
        group = "per-channel" if self.group_size == -1 else f"group {self.group_size}"
        extras = [] if self.fmt == "awq" else ["symmetric" if self.symmetric else "asymmetric"]
        if self.act_order:
            extras.append("act-order")
        extras = "".join(f", {e}" for e in extras) if self.fmt == "ct" else ""
        return f"W{self.bits}A16 ({group}{extras})"


class WNA16LinearMethod(LinearMethod):
    def __init__(self, quantization: str, scheme: WNA16Scheme):
        self.quantization = quantization
        self.scheme = scheme

    def describe(self) -> str:
        return f"{self.quantization}: {self.scheme.describe()}"

    # -- weights ----------------------------------------------------------------------------------
    def _groups(self, layer: nn.Module) -> tuple[int, int]:
        k = layer.in_features
        g = k if self.scheme.group_size == -1 else self.scheme.group_size
        if k % g:
            raise ValueError(f"{self.describe()}: group size {g} does not divide the input features {k}")
        return g, k // g

    def create_weights(self, layer: nn.Module) -> None:
        s, n, k = self.scheme, layer.out_features, layer.in_features
        p = 32 // s.bits
        g, ng = self._groups(layer)
        if k % p or (s.fmt != "ct" and n % p):
            raise ValueError(f"{self.describe()}: layer [{n}, {k}] does not pack into int32 words of {p} values")
        plain_g_idx = (torch.arange(k, dtype=torch.int32) // g)
        i32 = torch.int32
        # Along the input (a row-parallel rank's part): packed words hold p inputs, group tensors one
        # row per group (per-channel scales have one group for every rank: kept whole).
        gin = 0 if s.group_size != -1 else None
        if s.fmt == "gptq":
            register_param(layer, "qweight", torch.zeros(k // p, n, dtype=i32),
                           ParamLayout(output_dim=1, input_dim=0, input_pack_factor=p))
            register_param(layer, "qzeros", torch.zeros(ng, n // p, dtype=i32),
                           ParamLayout(output_dim=1, pack_factor=p, input_dim=gin, input_pack_factor=g))
            register_param(layer, "scales", torch.ones(ng, n, dtype=torch.float32),
                           ParamLayout(output_dim=1, input_dim=gin, input_pack_factor=g))
            register_param(layer, "g_idx", plain_g_idx, ParamLayout(output_dim=None, input_dim=0))
        elif s.fmt == "awq":
            register_param(layer, "qweight", torch.zeros(k, n // p, dtype=i32),
                           ParamLayout(output_dim=1, pack_factor=p, input_dim=0))
            register_param(layer, "qzeros", torch.zeros(ng, n // p, dtype=i32),
                           ParamLayout(output_dim=1, pack_factor=p, input_dim=gin, input_pack_factor=g))
            register_param(layer, "scales", torch.ones(ng, n, dtype=torch.float32),
                           ParamLayout(output_dim=1, input_dim=gin, input_pack_factor=g))
        else:
            gin = 1 if s.group_size != -1 else None
            register_param(layer, "weight_packed", torch.zeros(n, k // p, dtype=i32),
                           ParamLayout(output_dim=0, input_dim=1, input_pack_factor=p))
            register_param(layer, "weight_scale", torch.ones(n, ng, dtype=torch.float32),
                           ParamLayout(output_dim=0, input_dim=gin, input_pack_factor=g))
            if not s.symmetric:
                register_param(layer, "weight_zero_point", torch.zeros(-(-n // p), ng, dtype=i32),
                               ParamLayout(output_dim=0, pack_factor=p, input_dim=gin, input_pack_factor=g))
            if s.act_order:
                register_param(layer, "weight_g_idx", plain_g_idx, ParamLayout(output_dim=None, input_dim=0))
        layer.wna16_shared_loaded = set()

    def load(self, layer: nn.Module, name: str, tensor: torch.Tensor, shard: str | None) -> None:
        if self.scheme.fmt == "ct" and name == "weight_shape":
            # [out, in] of this checkpoint module (one shard of a merged layer): checked, not kept
            size = layer.shard_offsets[shard][1] if shard is not None else layer.out_features
            got = tuple(int(v) for v in tensor.reshape(-1).tolist())
            expect = (size, layer.in_features)
            # a tensor-parallel rank holds a part of the side it splits: only the other is checked
            if getattr(layer, "tp_output", None) and len(got) == 2:
                expect = (got[0], layer.in_features)
            elif getattr(layer, "tp_input", None) is not None and len(got) == 2:
                expect = (size, got[1])
            if got != expect:
                where = f" (shard {shard!r})" if shard is not None else ""
                raise ValueError(f"weight_shape{where}: checkpoint says {got}, the layer expects {expect}")
            return
        if name in ("g_idx", "weight_g_idx") and name in layer.param_layouts:
            # one input permutation for the whole merged layer: every shard must carry the same
            g_idx = getattr(layer, name)
            tensor = self._local_groups(layer, name, tensor)
            if tensor.shape != g_idx.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} does not match {tuple(g_idx.shape)}")
            if name in layer.wna16_shared_loaded and not torch.equal(g_idx.data, tensor.to(g_idx.dtype)):
                raise ValueError(f"{name} (shard {shard!r}) differs from another shard's; the shards of one merged "
                                 f"layer share their input channel order")
            layer.wna16_shared_loaded.add(name)
        super().load(layer, name, tensor, shard)

    def _local_groups(self, layer: nn.Module, name: str, g_idx: torch.Tensor) -> torch.Tensor:
        """A row-parallel rank's part of g_idx numbers the checkpoint's groups; its scales hold the
        rank's groups only. Renumbered from the rank's first group; an input channel of this rank
        in another rank's group (act-order across parts) cannot be served by the part's scales."""
        part = getattr(layer, "tp_input", None)
        if part is None or self.scheme.group_size == -1:
            return g_idx
        g, ng = self._groups(layer)
        local = g_idx.to(torch.int64) - part * ng
        if local.numel() and (local.min() < 0 or local.max() >= ng):
            raise ValueError(f"{name}: this tensor-parallel rank's input channels use quantization groups of other "
                             f"ranks (act-order across parts); serve this checkpoint with fewer ranks")
        return local.to(g_idx.dtype)

    def _canonical(self, layer: nn.Module) -> WNA16Weight:
        s = self.scheme
        g, _ = self._groups(layer)
        if s.fmt == "gptq":
            return from_gptq(layer.qweight.data, layer.qzeros.data, layer.scales.data, bits=s.bits, group_size=g,
                             g_idx=layer.g_idx.data, checkpoint_format=s.checkpoint_format)
        if s.fmt == "awq":
            return from_awq(layer.qweight.data, layer.qzeros.data, layer.scales.data, group_size=g)
        zp = layer.weight_zero_point.data if not s.symmetric else None
        g_idx = layer.weight_g_idx.data if s.act_order else None
        return from_compressed_tensors(layer.weight_packed.data, layer.weight_scale.data, bits=s.bits, group_size=g,
                                       weight_zero_point=zp, weight_g_idx=g_idx,
                                       weight_shape=(layer.out_features, layer.in_features))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = getattr(layer, "wna16_random", None) or self._canonical(layer)
        for name in _LOADED_PARAMS[self.scheme.fmt]:
            if name in layer._parameters:
                del layer._parameters[name]
            layer.param_layouts.pop(name, None)
        layer.wna16_random = None
        replace_param(layer, "qweight", w.qweight)
        replace_param(layer, "scales", w.scales.float().contiguous())
        layer.zeros = None if w.zeros is None else nn.Parameter(w.zeros, requires_grad=False)
        layer.perm = None if w.perm is None else nn.Parameter(w.perm, requires_grad=False)
        layer.wna16_bits, layer.wna16_group_size = w.bits, w.group_size
        # a constant per layer: the Triton kernels need CUDA and a 16-bit activation dtype
        layer.wna16_kernel = w.qweight.device.type == "cuda" and layer.params_dtype in (torch.bfloat16, torch.float16)

    def init_random(self, layer: nn.Module, generator: torch.Generator) -> None:
        s = self.scheme
        w = torch.empty(layer.out_features, layer.in_features, device=generator.device)
        w.normal_(0.0, 0.02, generator=generator)
        layer.wna16_random = quantize_rtn(w, s.bits, s.group_size, symmetric=s.fmt != "awq" and s.symmetric)

    # -- compute ----------------------------------------------------------------------------------
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        bits, group = layer.wna16_bits, layer.wna16_group_size
        if layer.wna16_kernel:
            out = wna16_linear_op(x2, layer.qweight, layer.scales, layer.zeros, layer.perm, layer.bias, bits, group)
        else:  # the torch reference: dequantize, float32 matmul
            out = wna16_linear(x2.float(), layer.qweight, layer.scales, layer.zeros, bits=bits, group_size=group,
                               perm=layer.perm, bias=layer.bias)
        return out.to(x.dtype).reshape(*x.shape[:-1], layer.out_features)

    def cheaper_at_one_row(self, layer: nn.Module) -> bool:
        # The GEMV (symmetric int4 on CUDA) does the FFMAs of every row: 2.12 against 2.61 ms per 8B
        # step at 1 and 2 tokens on the H100 (wna16_gemm.WNA16_GEMV_MAX_M). The split-K kernel pads
        # x to 16 rows, so one token costs what two do.
        return layer.wna16_kernel and wna16_route(1, bits=layer.wna16_bits, has_zeros=layer.zeros is not None) == "gemv"


# -- the "gptq" and "awq" quantization configs -------------------------------------------------------
def _is_lm_head(name: str) -> bool:
    return name == "lm_head" or name.endswith(".lm_head")


class _WeightOnlyConfig(QuantConfig):
    def __init__(self, scheme: WNA16Scheme, not_converted: list[str], quantize_lm_head: bool = False):
        self.method = WNA16LinearMethod(self.name, scheme)
        self.not_converted = list(not_converted)
        self.quantize_lm_head = quantize_lm_head

    def _method_of(self, name: str) -> LinearMethod:
        if _is_lm_head(name) and not self.quantize_lm_head:
            return UNQUANTIZED
        parts = name.split(".")
        if any(m in parts or name.endswith(m) for m in self.not_converted):
            return UNQUANTIZED
        return self.method

    def linear_method(self, names: list[str]) -> LinearMethod:
        return same_method([self._method_of(n) for n in names], names)

    def describe(self) -> str:
        return self.method.describe()


class GPTQConfig(_WeightOnlyConfig):
    """`quant_method: gptq` (AutoGPTQ / GPTQModel / optimum): bits, group_size, desc_act (act-order,
    read from g_idx), sym, checkpoint_format, lm_head."""
    name = "gptq"

    @classmethod
    def from_checkpoint(cls, cfg: dict) -> "GPTQConfig":
        if cfg.get("dynamic"):
            raise ValueError("gptq: per-module overrides (`dynamic`) are not supported")
        fmt = cfg.get("checkpoint_format") or "gptq"
        if str(fmt).lower() == "marlin":
            raise ValueError("gptq: checkpoint_format 'marlin' (Marlin-repacked weights) is not supported")
        scheme = WNA16Scheme("gptq", int(cfg.get("bits", 4)), int(cfg.get("group_size", 128)),
                             symmetric=bool(cfg.get("sym", True)), checkpoint_format=str(fmt).lower())
        return cls(scheme, list(cfg.get("modules_to_not_convert") or []), bool(cfg.get("lm_head", False)))


class AWQConfig(_WeightOnlyConfig):
    """`quant_method: awq` (AutoAWQ, GEMM packing): bits / w_bit, group_size / q_group_size,
    zero_point, modules_to_not_convert."""
    name = "awq"

    @classmethod
    def from_checkpoint(cls, cfg: dict) -> "AWQConfig":
        version = str(cfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"awq: version {version!r} is not supported (only the GEMM packing)")
        if not cfg.get("zero_point", True):
            raise ValueError("awq: checkpoints without zero points are not supported")
        bits = int(cfg.get("bits", cfg.get("w_bit", 4)))
        group = int(cfg.get("group_size", cfg.get("q_group_size", 128)))
        return cls(WNA16Scheme("awq", bits, group), list(cfg.get("modules_to_not_convert") or []))
