"""Checkpoints written by compressed-tensors (llm-compressor): `quant_method: compressed-tensors`.

The config holds `config_groups`, each a scheme (weights / input_activations quantization args)
with `targets` (a class name such as "Linear", an exact module name, or "re:<regex>" matched from
the start of the module name), and `ignore` (same spelling). A layer takes the first group that
targets it unless ignored. Supported schemes: FP8 weights (per tensor, per channel, 128x128-style
blocks) with static per-tensor, dynamic per-token or dynamic per-group activations, or none; and
W8A8 INT8 (per-channel or per-tensor weights, dynamic per-token or static activations); and
weight-only W4A16 / W8A16 in the `pack-quantized` format (group or channel, symmetric or with
zero points, actorder "group" through weight_g_idx; wna16.py). The config
is read as plain JSON: importing compressed-tensors itself takes seconds.
"""
from __future__ import annotations

import logging
import re

from splitserve.layers.quantization.base import (UNQUANTIZED, LinearMethod, QuantConfig, name_variants, names_match,
                                                 same_method)
from splitserve.layers.quantization.fp8 import Fp8LinearMethod, Fp8Scheme
from splitserve.layers.quantization.int8 import Int8LinearMethod, Int8Scheme
from splitserve.layers.quantization.wna16 import WNA16LinearMethod, WNA16Scheme

logger = logging.getLogger(__name__)

NAME = "compressed-tensors"
_LAYER_CLASSES = ("Linear", "LinearBase")  # what our Linear answers to as a target
_KV_SCALE = re.compile(r"\.(k_scale|v_scale|q_scale|prob_scale)$")


def _matches(name: str, target: str) -> bool:
    """compressed-tensors' rule (a class name, an exact name, or "re:" matched from the start),
    over the spellings of the name (base.name_variants: tools write `language_model.lm_head` for
    transformers' `lm_head`)."""
    if target.startswith("re:"):
        return any(re.match(target[3:], n) is not None for n in name_variants(name))
    return target in _LAYER_CLASSES or names_match(name, target)


def _describe_args(args: dict | None) -> str:
    if not args:
        return "none"
    keys = ("type", "num_bits", "strategy", "dynamic", "symmetric", "group_size", "block_structure")
    return ", ".join(f"{k}={args.get(k)}" for k in keys if args.get(k) is not None)


def _strategy(args: dict) -> str:
    strategy = args.get("strategy")
    if strategy is None:  # as compressed-tensors infers it
        group = args.get("group_size")
        strategy = "tensor" if group is None else ("channel" if group == -1 else "group")
    return strategy


class CompressedTensorsConfig(QuantConfig):
    name = NAME

    def __init__(self, cfg: dict):
        status = cfg.get("quantization_status", "compressed")
        if status not in ("compressed", "frozen"):
            raise ValueError(f"{NAME}: quantization_status {status!r} is not a saved quantized checkpoint")
        if cfg.get("sparsity_config"):
            raise ValueError(f"{NAME}: sparse checkpoints (sparsity_config) are not supported")
        if cfg.get("transform_config"):
            raise ValueError(f"{NAME}: checkpoints with transforms (transform_config) are not supported")
        groups = cfg.get("config_groups") or {}
        if not groups:
            raise ValueError(f"{NAME}: the quantization_config has no config_groups")
        self.ignore = list(cfg.get("ignore") or [])
        self.kv_cache_scheme = cfg.get("kv_cache_scheme")
        if self.kv_cache_scheme:
            logger.warning("%s: the checkpoint's KV-cache scales are not used; the KV cache stays in the "
                           "model's dtype", NAME)
        self._methods: dict[object, LinearMethod] = {}  # one instance per scheme, shared by its layers
        self.groups: list[tuple[list[str], LinearMethod]] = []
        for group_name, group in groups.items():
            targets = group.get("targets") or []
            self.groups.append((targets, self._method(group_name, group, group.get("format") or cfg.get("format"))))

    def _method(self, group_name: str, group: dict, fmt: str | None) -> LinearMethod:
        w, a = group.get("weights"), group.get("input_activations")
        where = f"{NAME} group {group_name!r}"
        if group.get("output_activations"):
            raise ValueError(f"{where}: output activation quantization is not supported")
        if not w:
            raise ValueError(f"{where}: activation-only quantization is not supported")
        weight_only_int = a is None and w.get("type", "int") == "int"  # these may carry zero points
        for args in () if weight_only_int else (w, a):
            if args and not args.get("symmetric", True):
                raise ValueError(f"{where}: asymmetric quantization ({_describe_args(args)}) is not supported")
        scheme = self._scheme(where, w, a, fmt)
        if scheme not in self._methods:
            cls = {Fp8Scheme: Fp8LinearMethod, Int8Scheme: Int8LinearMethod, WNA16Scheme: WNA16LinearMethod}[type(scheme)]
            self._methods[scheme] = cls(NAME, scheme)
        return self._methods[scheme]

    @staticmethod
    def _scheme(where: str, w: dict, a: dict | None, fmt: str | None):
        w_type, w_bits, w_strategy = w.get("type", "int"), w.get("num_bits", 8), _strategy(w)
        unsupported = (f"{where}: weights ({_describe_args(w)}) with activations ({_describe_args(a)}) "
                       f"in format {fmt!r} are not supported")
        if w_type == "float" and w_bits == 8:
            if fmt not in (None, "float-quantized", "naive-quantized"):
                raise ValueError(unsupported)
            if w_strategy not in ("tensor", "channel", "block"):
                raise ValueError(unsupported)
            block = tuple(w["block_structure"]) if w_strategy == "block" else None
            if a is None:
                return Fp8Scheme(w_strategy, "none", block, zero_points=True)
            if a.get("type") != "float" or a.get("num_bits") != 8:
                raise ValueError(unsupported)
            a_strategy, dynamic = _strategy(a), a.get("dynamic") is True
            if a_strategy == "token" and dynamic:
                act = "token"
            elif a_strategy == "tensor" and not dynamic:
                act = "static"
            elif a_strategy == "group" and dynamic and block is not None and a.get("group_size") == block[1]:
                act = "group"
            else:
                raise ValueError(unsupported)
            return Fp8Scheme(w_strategy, act, block, zero_points=True)
        if w_type == "int" and w_bits == 8 and a is not None:
            if fmt not in (None, "int-quantized", "naive-quantized"):
                raise ValueError(unsupported)
            if a.get("type", "int") != "int" or a.get("num_bits") != 8 or w_strategy not in ("channel", "tensor"):
                raise ValueError(unsupported)
            a_strategy, dynamic = _strategy(a), a.get("dynamic") is True
            if a_strategy == "token" and dynamic:
                return Int8Scheme(w_strategy, "token", zero_points=True)
            if a_strategy == "tensor" and not dynamic:
                return Int8Scheme(w_strategy, "static", zero_points=True)
            raise ValueError(unsupported)
        if w_type == "int" and a is None:
            if fmt != "pack-quantized" or w_strategy not in ("group", "channel") or w.get("num_bits") not in (4, 8):
                raise ValueError(f"{where}: weight-only integer quantization ({_describe_args(w)}, format {fmt!r}) "
                                 f"is not supported (pack-quantized 4 or 8 bits, group or channel strategy is)")
            actorder = w.get("actorder")
            if actorder not in (None, "group", "weight", "static", "dynamic", False):
                raise ValueError(f"{where}: actorder {actorder!r} is not supported")
            group = -1 if w_strategy == "channel" else int(w.get("group_size") or 0)
            return WNA16Scheme("ct", int(w["num_bits"]), group, symmetric=w.get("symmetric", True) is not False,
                               act_order=actorder == "group")
        raise ValueError(unsupported)

    def _method_of(self, name: str) -> LinearMethod:
        if any(_matches(name, t) for t in self.ignore):
            return UNQUANTIZED
        for targets, method in self.groups:
            if any(_matches(name, t) for t in targets):
                return method
        return UNQUANTIZED

    def linear_method(self, names: list[str]) -> LinearMethod:
        return same_method([self._method_of(n) for n in names], names)

    def skip_tensor(self, name: str) -> bool:
        return bool(self.kv_cache_scheme) and _KV_SCALE.search(name) is not None

    def describe(self) -> str:
        methods = list(dict.fromkeys(m.describe() for _, m in self.groups))
        return "; ".join(methods)
