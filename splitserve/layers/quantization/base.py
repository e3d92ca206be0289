"""The seam between a linear layer and its quantization method.

A `Linear` (or `MergedLinear`) owns no weights of its own: its method creates them
(`create_weights`), places each checkpoint tensor in them (`load`, shard-aware), converts them once
loading is done (`process_weights_after_loading`), and computes the layer (`apply`). The plain
float path is `UnquantizedLinearMethod`: a `weight` parameter and `F.linear`, exactly as before.

Shard-aware loading is data, not code: each parameter a method registers has a `ParamLayout`
saying which of its dimensions runs along the layer's output features (and how many output
features one stored element holds: a packed int4 word holds 8, a 128x128 weight block's scale
128), or that it holds one value per merged shard (per-tensor scales, which differ per shard).
`load_param` then narrows the parameter to the shard's rows. A W4A16 method (packed `qweight`,
group `scales`, packed `qzeros`, `g_idx`) declares its parameters with layouts and needs no loader
of its own.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.layers.activation import silu_and_mul
from splitserve.layers.cpu_gemm import linear


class UnclaimedTensorError(ValueError):
    """A checkpoint tensor that no parameter of the layer (and so no method) takes. The model's
    loader re-raises it naming the checkpoint tensor."""

    def __init__(self, param_name: str, method: "LinearMethod"):
        super().__init__(f"no parameter {param_name!r} in this layer (quantization: {method.describe()})")
        self.param_name = param_name


@dataclass(frozen=True)
class ParamLayout:
    """How a method's parameter lines up with the layer's output features (see the module doc).

    output_dim: the dimension that runs along output features (shards are cut there); None for a
      parameter every shard shares whole (an input-side permutation such as GPTQ's g_idx: each
      shard's copy must be the same).
    pack_factor: output features per stored element along output_dim (8 for int4 packed in int32,
      the block height for block scales); a shard starts at offset // pack_factor.
    per_shard: one value per merged shard (a per-tensor scale); the parameter is [num_shards].
    input_dim: the dimension that runs along input features, where a row-parallel layer's ranks cut
      their parts (None: every rank keeps it whole, e.g. a per-output-channel scale).
    input_pack_factor: input features per stored element along input_dim (the group size of a
      group-wise scale, the block width of a block scale, 8 for int4 packed along the input).

    Tensor parallelism reads the same layout: a column-parallel rank keeps its part of output_dim,
    a row-parallel rank its part of input_dim; per-shard (per-tensor) values are replicated.
    """
    output_dim: int | None = 0
    pack_factor: int = 1
    per_shard: bool = False
    input_dim: int | None = None
    input_pack_factor: int = 1


def register_param(layer: nn.Module, name: str, tensor: torch.Tensor, layout: ParamLayout) -> nn.Parameter:
    param = nn.Parameter(tensor, requires_grad=False)
    layer.register_parameter(name, param)
    layer.param_layouts[name] = layout
    return param


def replace_param(layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """After loading: swap a parameter for its converted form (its layout no longer matters)."""
    if name in layer._parameters:
        del layer._parameters[name]
    layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))


def as_tensor(tensor) -> torch.Tensor:
    """A checkpoint tensor, read now if it is still a lazy slice of a file (safetensors_io.LazySlice)."""
    return tensor if isinstance(tensor, torch.Tensor) else tensor.materialize()


def copy_checkpoint_tensor(param: torch.Tensor, tensor, what: str) -> None:
    """param <- a whole (unsharded) checkpoint tensor, read now if lazy; a shape that differs is an
    error naming `what`."""
    tensor = as_tensor(tensor)
    if param.shape != tensor.shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
    param.data.copy_(tensor)


def _cut(tensor, dim: int, start: int, length: int, what: str):
    """tensor[start:start + length] along dim, zero-padded where it runs past the end (the last
    rank's part of a vocabulary padded to a multiple of the ranks); lazy slices stay lazy."""
    full = tensor.shape[dim]
    if start + length > full and what != "pad":
        raise ValueError(f"checkpoint dimension {dim} has {full} elements; this rank's part is "
                         f"[{start}, {start + length})")
    have = max(0, min(length, full - start))
    part = tensor.narrow(dim, min(start, full), have)
    if have == length:
        return part
    part = as_tensor(part)
    pad = [0, 0] * (part.dim() - 1 - dim) + [0, length - have]
    return torch.nn.functional.pad(part, pad)


def rank_part(layer: nn.Module, name: str, tensor, shard: str | None):
    """This tensor-parallel rank's part of one checkpoint tensor, cut by the parameter's layout:
    a column-parallel layer (`layer.tp_output`: shard -> index of the part this rank holds, each
    part as long as the rank's shard) along output_dim, a row-parallel one (`layer.tp_input`: the
    part's index) along input_dim. Layers of one rank (both unset) get the tensor untouched.
    Runs before anything is read, so a lazy safetensors slice reads only this part."""
    layout = layer.param_layouts.get(name)
    if layout is None or layout.per_shard:
        return tensor
    tp_output, tp_input = getattr(layer, "tp_output", None), getattr(layer, "tp_input", None)
    if tp_output and layout.output_dim is not None:
        index = tp_output[shard]
        size = layer.shard_offsets[shard][1] if shard is not None else layer.out_features
        pf = layout.pack_factor
        if (index * size) % pf:
            raise ValueError(f"{name}: a tensor-parallel part of {size} output features does not start on a "
                             f"stored element ({pf} output features each); use fewer ranks")
        what = "pad" if getattr(layer, "tp_pads_output", False) else "exact"
        return _cut(tensor, layout.output_dim, index * size // pf, -(-size // pf), what)
    if tp_input is not None and layout.input_dim is not None:
        k, ipf = layer.in_features, layout.input_pack_factor
        if k % ipf:
            raise ValueError(f"{name}: a tensor-parallel part of {k} input features is not a whole number of "
                             f"stored elements ({ipf} input features each); use fewer ranks")
        return _cut(tensor, layout.input_dim, tp_input * k // ipf, k // ipf, "exact")
    return tensor


def load_param(layer: nn.Module, name: str, tensor: torch.Tensor, shard: str | None,
               method: "LinearMethod") -> None:
    """Copies one checkpoint tensor into the parameter `name`, or into its shard's part."""
    param = layer._parameters.get(name)
    layout = layer.param_layouts.get(name)
    if param is None or layout is None:
        raise UnclaimedTensorError(name, method)
    dest = param.data
    shard_names = list(layer.shard_offsets)
    if layout.per_shard:
        if tensor.numel() != 1:
            raise ValueError(f"{name}: expected one value per shard, got shape {tuple(tensor.shape)}")
        if shard is None:
            dest.fill_(tensor.reshape(()).item())  # one value for the whole (possibly merged) layer
        else:
            dest[shard_names.index(shard)].copy_(tensor.reshape(()))
        return
    if shard is not None and layout.output_dim is not None:
        offset, size = layer.shard_offsets[shard]
        pf = layout.pack_factor
        if offset % pf:
            raise ValueError(f"{name}: shard {shard!r} starts at output feature {offset}, not a multiple of "
                             f"{pf} (the parameter stores {pf} output features per element)")
        dest = dest.narrow(layout.output_dim, offset // pf, math.ceil(size / pf))
    if dest.shape != tensor.shape:
        if dest.numel() == tensor.numel() and dest.dim() != tensor.dim():
            tensor = tensor.reshape(dest.shape)  # [N] vs [N, 1] scale spellings of the same values
        else:
            where = f" (shard {shard!r})" if shard is not None else ""
            raise ValueError(f"{name}{where}: checkpoint shape {tuple(tensor.shape)} does not match "
                             f"{tuple(dest.shape)}")
    dest.copy_(tensor)


class LinearMethod:
    """How a linear layer stores, loads and computes its weights. One instance may serve many
    layers (all state lives on the layer), so compiled code sees the same object in every layer."""

    #: vLLM's name of the quantization this method belongs to (None: unquantized)
    quantization: str | None = None

    def create_weights(self, layer: nn.Module) -> None:
        """Registers the layer's parameters (`register_param`); `layer.in_features`,
        `layer.out_features`, `layer.shard_offsets` and `layer.params_dtype` are set."""
        raise NotImplementedError

    def load(self, layer: nn.Module, name: str, tensor: torch.Tensor, shard: str | None) -> None:
        """Places one checkpoint tensor (the part after the module name, e.g. `weight_scale`);
        raises UnclaimedTensorError for a name the method does not take."""
        load_param(layer, name, tensor, shard, self)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Once every tensor is in: quantize online, merge per-shard scales, pick the matmul."""

    def init_random(self, layer: nn.Module, generator: torch.Generator) -> None:
        """Random weights (benchmarks without a checkpoint) for parameters that a plain N(0, 0.02)
        draw cannot fill (quantized storage, scales). Float weights are already drawn."""

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def apply_silu_mul(self, layer: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
        """The layer applied to silu(gate) * up, for gate_up = [gate | up] (a gated MLP's down
        projection). Methods whose kernels quantize their input override it to fuse the activation
        into that quantization (FP8, INT8 with dynamic per-token activations)."""
        return self.apply(layer, silu_and_mul(gate_up))

    def cheaper_at_one_row(self, layer: nn.Module) -> bool:
        """True when `apply` costs clearly less for one token than for two (a GEMV whose work grows
        with each row, where a matmul kernel pads to a tile and costs the same). The runner then
        captures a decode graph of one sequence instead of padding it to two, and the compiled layers
        get one more Inductor specialisation, for one token. Asked after the weights are converted."""
        return False

    def describe(self) -> str:
        return self.quantization or "unquantized"


class UnquantizedLinearMethod(LinearMethod):
    """The model's own float weights: `weight` [out, in] (and the layer's `bias`), `F.linear`."""

    def create_weights(self, layer: nn.Module) -> None:
        register_param(layer, "weight", torch.empty(layer.out_features, layer.in_features, dtype=layer.params_dtype),
                       ParamLayout(output_dim=0, input_dim=1))

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return linear(x, layer.weight, layer.bias)  # F.linear; column blocks on CPU where faster


UNQUANTIZED = UnquantizedLinearMethod()


class QuantConfig:
    """A checkpoint's (or the `--quantization` flag's) quantization: which method each linear
    layer gets, by the checkpoint names of the modules it stands for."""

    #: vLLM's name: "fp8", "compressed-tensors", "modelopt", ...
    name: str = ""

    def linear_method(self, names: list[str]) -> LinearMethod:
        """The method for a layer standing for the checkpoint modules `names` (one per shard of a
        merged layer; all must resolve to the same method)."""
        raise NotImplementedError

    def skip_tensor(self, name: str) -> bool:
        """True for checkpoint tensors the format carries that the engine deliberately leaves
        unused (say, KV-cache scales while the KV cache is not quantized)."""
        return False

    def describe(self) -> str:
        return self.name


_WRAPPERS = re.compile(r"(^|\.)(model|language_model)(?=\.)")


def name_variants(name: str) -> tuple[str, ...]:
    """The spellings of one module's checkpoint name that quantization configs use: as the model
    code names it (transformers' module names: `model.language_model.layers.0.mlp.down_proj`,
    `lm_head`) and without the `model.` / `language_model.` wrappers that differ between
    transformers versions and tools (`language_model.lm_head`, `language_model.model.layers...`
    and `layers...` are the same modules)."""
    bare = _WRAPPERS.sub("", name).lstrip(".")
    return (name,) if bare == name else (name, bare)


def names_match(name: str, entry: str) -> bool:
    """An exact-name config entry (ignore list, exclude list) names this module, in any spelling."""
    return bool(set(name_variants(name)) & set(name_variants(entry)))


def same_method(methods: list[LinearMethod], names: list[str]) -> LinearMethod:
    """A merged layer runs one matmul, so its shards must be quantized alike."""
    if any(m is not methods[0] for m in methods):
        detail = ", ".join(f"{n}: {m.describe()}" for n, m in zip(names, methods))
        raise ValueError(f"the shards of one merged layer are quantized differently ({detail}); "
                         f"splitserve runs them as one matmul and needs them alike")
    return methods[0]


def method_for(quant_config: QuantConfig | None, *names: str) -> LinearMethod:
    """What model code calls: the method of the layer standing for the checkpoint modules `names`."""
    return UNQUANTIZED if quant_config is None else quant_config.linear_method(list(names))
