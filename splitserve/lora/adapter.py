"""LoRA adapters in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`), checked
against the base model and read into host memory.

Everything an adapter may not do is refused here, with a message naming what is wrong, before any
request runs with it: DoRA, biases or saved whole modules, modules splitserve has no LoRA for (embeddings,
the LM head, a vision tower), a rank above --max-lora-rank, and shapes that do not fit the base model
(an adapter trained on another model).

Module names: PEFT saves `base_model.model.<the model's module path>.lora_A.weight` ([r, in]) and
`.lora_B.weight` ([out, r]); only `layers.<i>.(self_attn|mlp).<p>_proj` is kept from the path, so the
same adapter fits a text model and the language model of a VLM.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from splitserve.protocol.lora import LoRAModuleWeights

# Projections that take LoRA, by PEFT's module names; q/k/v and gate/up are shards of merged layers.
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.lora_([AB])(?:\.[^.]+)?\.weight$")


@dataclass(frozen=True)
class LoRATargets:
    """The base model's shapes an adapter must fit: (in, out) features of each projection."""
    num_layers: int
    shapes: dict[str, tuple[int, int]]

    @classmethod
    def from_hf_config(cls, hf_config) -> "LoRATargets":
        cfg = getattr(hf_config, "text_config", None) or hf_config
        H, I = cfg.hidden_size, cfg.intermediate_size
        nh = cfg.num_attention_heads
        nkv = getattr(cfg, "num_key_value_heads", None) or nh
        hd = getattr(cfg, "head_dim", None) or H // nh
        return cls(cfg.num_hidden_layers, {"q": (H, nh * hd), "k": (H, nkv * hd), "v": (H, nkv * hd),
                                          "o": (nh * hd, H), "gate": (H, I), "up": (H, I), "down": (I, H)})


@dataclass
class LoRAAdapter:
    """One adapter in host memory: per (layer, projection) A [r, in] and B [out, r] with the scaling
    already folded into B (scale * x A^T B^T == x A^T (scale B)^T)."""
    lora_int_id: int
    name: str
    path: str
    rank: int                      # the largest rank of any of its modules
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())

    def modules(self) -> list[LoRAModuleWeights]:
        """Its weights as the step message's slot load carries them (the same tensors, not copies)."""
        return [LoRAModuleWeights(layer, proj, a, b) for (layer, proj), (a, b) in self.weights.items()]

    def pin_memory(self) -> "LoRAAdapter":
        """Its weights in page-locked memory, so that slot loads copy them without a host copy or a
        stream synchronisation (done on the loader thread, off the step loop)."""
        self.weights = {key: (a.pin_memory(), b.pin_memory()) for key, (a, b) in self.weights.items()}
        return self


def _read_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {path!r}: not a directory (give the local directory PEFT's "
                         f"save_pretrained wrote; adapters are not downloaded)")
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"LoRA adapter {path!r}: no adapter_config.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {path!r}: adapter_config.json is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"LoRA adapter {path!r}: adapter_config.json is not a JSON object")
    return cfg


def _check_config(path: str, cfg: dict, max_rank: int) -> None:
    where = f"LoRA adapter {path!r}"
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {cfg.get('peft_type')!r} is not supported (only LORA)")
    if cfg.get("use_dora"):
        raise ValueError(f"{where}: DoRA (use_dora: true) is not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{where}: LoRA biases (bias: {cfg.get('bias')!r}) are not supported")
    if cfg.get("modules_to_save"):
        raise ValueError(f"{where}: modules_to_save {cfg['modules_to_save']} (whole trained modules) are not supported")
    if cfg.get("fan_in_fan_out"):
        raise ValueError(f"{where}: fan_in_fan_out adapters are not supported")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(t for t in targets if t.rsplit(".", 1)[-1] not in {f"{p}_proj" for p in PROJECTIONS})
        if unknown:
            raise ValueError(f"{where}: target modules {unknown} are not supported (LoRA runs on "
                             f"{', '.join(p + '_proj' for p in PROJECTIONS)})")
    ranks = [cfg.get("r", 8)] + list((cfg.get("rank_pattern") or {}).values())
    if max(ranks) > max_rank:
        raise ValueError(f"{where}: rank {max(ranks)} is above --max-lora-rank {max_rank}")


def _alpha_for(cfg: dict, module_path: str) -> float:
    """PEFT's alpha_pattern: a key matches a module whose name ends with it (a regex)."""
    for key, alpha in (cfg.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module_path):
            return float(alpha)
    return float(cfg.get("lora_alpha", 8))


def _tensor_file(path: str) -> str:
    for name in ("adapter_model.safetensors", "adapter_model.bin"):
        if os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name)
    raise ValueError(f"LoRA adapter {path!r}: no adapter_model.safetensors (or adapter_model.bin)")


def _iter_tensors(file: str, load: bool):
    """(name, tensor or just its shape) of every tensor in the file."""
    if file.endswith(".safetensors"):
        from safetensors import safe_open
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, (f.get_tensor(name) if load else tuple(f.get_slice(name).get_shape()))
    else:
        for name, t in torch.load(file, map_location="cpu", weights_only=True).items():
            yield name, (t if load else tuple(t.shape))


def load_adapter(lora_int_id: int, name: str, path: str, targets: LoRATargets, max_rank: int,
                 dtype: torch.dtype = torch.float32, load: bool = True) -> LoRAAdapter:
    """Reads and checks an adapter. With load=False only its config and tensor shapes are read (the
    front's check); the weights stay empty."""
    cfg = _read_config(path)
    _check_config(path, cfg, max_rank)
    where = f"LoRA adapter {path!r}"
    pairs: dict[tuple[int, str], dict[str, object]] = {}
    for tname, value in _iter_tensors(_tensor_file(path), load):
        if "vision" in tname or "visual" in tname:
            raise ValueError(f"{where}: tensor {tname!r} targets the vision tower; LoRA runs on the language model only")
        m = _TENSOR.search(tname)
        if m is None:
            raise ValueError(f"{where}: tensor {tname!r} is not a LoRA A/B of a module splitserve supports "
                             f"({', '.join(p + '_proj' for p in PROJECTIONS)} of the decoder layers)")
        layer, proj, ab = int(m.group(1)), m.group(2), m.group(3)
        if layer >= targets.num_layers:
            raise ValueError(f"{where}: tensor {tname!r} is for layer {layer}, but the base model has "
                             f"{targets.num_layers} layers (an adapter of another model?)")
        pairs.setdefault((layer, proj), {})[ab] = value
        pairs[(layer, proj)]["path"] = tname[:tname.rindex(f".lora_{ab}")]  # the module's name (alpha_pattern)
    if not pairs:
        raise ValueError(f"{where}: no LoRA weights found")
    adapter = LoRAAdapter(lora_int_id, name, path, 0)
    for (layer, proj), entry in sorted(pairs.items()):
        if "A" not in entry or "B" not in entry:
            raise ValueError(f"{where}: layer {layer} {proj}_proj has lora_{'B' if 'A' in entry else 'A'} but not "
                             f"lora_{'A' if 'A' in entry else 'B'}")
        a, b = entry["A"], entry["B"]
        a_shape = tuple(a.shape) if load else a
        b_shape = tuple(b.shape) if load else b
        want_in, want_out = targets.shapes[proj]
        r = a_shape[0]
        if len(a_shape) != 2 or len(b_shape) != 2 or b_shape[1] != r:
            raise ValueError(f"{where}: layer {layer} {proj}_proj: lora_A {list(a_shape)} and lora_B {list(b_shape)} "
                             f"do not form a LoRA pair")
        if a_shape[1] != want_in or b_shape[0] != want_out:
            raise ValueError(f"{where}: base model mismatch: layer {layer} {proj}_proj is {want_in} -> {want_out} "
                             f"features in the base model, the adapter's is {a_shape[1]} -> {b_shape[0]}")
        if r > max_rank:
            raise ValueError(f"{where}: rank {r} (layer {layer} {proj}_proj) is above --max-lora-rank {max_rank}")
        adapter.rank = max(adapter.rank, r)
        if load:
            alpha = _alpha_for(cfg, str(entry["path"]))
            scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
            adapter.weights[(layer, proj)] = (a.to(dtype).contiguous(), (b.float() * scale).to(dtype).contiguous())
    return adapter
