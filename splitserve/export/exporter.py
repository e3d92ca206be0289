"""`splitserve export`: a model's batchful part as ONNX, the batchless cut as one node per layer.

How: torch's exporter (torch.onnx.export, the torch.export-based path) traces splitserve's own modules
(the decoder's layer halves, `start`, the final norm, `compute_logits`), so every family the decoder
serves exports through the same code as it serves. At the cut, the wrapper below calls
`splitserve_export::batchless_attention` (a torch custom op that exists only for tracing) instead of the
serving op; a translation maps it to one `ai.splitserve::BatchlessAttention` node with the layer's head
counts, head size, scale, index, window and soft cap as attributes. The op's definition in plain ONNX
(export/attention_graph.py) is then added as a local function. Building the whole graph by hand with
onnx.helper would have meant a second implementation of every family's batchful maths.

Files (loading/onnx_export.py names them): batchful.onnx (+ .data: the weights), embed_tokens.onnx
(+ .data: the table), batchless_prefill.onnx, batchless_decode.onnx, visual_encoder.onnx (VLMs), the
config, tokenizer, chat template, generation config and splitserve_export.json.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time

import torch
from torch import nn

from splitserve.export.attention_graph import (ATTRIBUTES, DOMAIN, DOMAIN_VERSION, INPUTS, OP_TYPE,
                                               batchless_attention_function, batchless_decode_model,
                                               batchless_prefill_model, register_schema)
from splitserve.loading import onnx_export as files
from splitserve.loading.hf_config import resolve_dtype
from splitserve.loading.resolve import load_tokenizer, resolve_model
from splitserve.models.decoder import DecoderForCausalLM
from splitserve.models.loader import load_hf_config, load_model
from splitserve.models.vlm_base import VisionLanguageModel

logger = logging.getLogger(__name__)
ROTARY_TABLE = "rotary_cos_sin"


@torch.library.custom_op("splitserve_export::batchless_attention", mutates_args=())
def batchless_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                        cos_sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                        layer_idx: int, sliding_window: int, soft_cap: float) -> torch.Tensor:
    """Stands for the batchless part while tracing; never run for its values."""
    return torch.empty_like(q)


@batchless_attention.register_fake
def _(q, k, v, positions, cos_sin, num_heads, num_kv_heads, head_dim, scale, layer_idx, sliding_window, soft_cap):
    return torch.empty_like(q)


def _translation():
    """The op -> one ai.splitserve::BatchlessAttention node (onnxscript, which torch's exporter uses)."""
    import onnxscript
    register_schema()
    opset = onnxscript.values.Opset(DOMAIN, DOMAIN_VERSION)

    def translate(q, k, v, positions, cos_sin, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                  layer_idx: int, sliding_window: int, soft_cap: float):
        return opset.BatchlessAttention(q, k, v, positions, cos_sin, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                        head_dim=head_dim, scale=scale, layer_idx=layer_idx,
                                        sliding_window=sliding_window, soft_cap=soft_cap)
    return {torch.ops.splitserve_export.batchless_attention.default: translate}


class Batchful(nn.Module):
    """inputs_embeds [T, hidden], positions [T], logits_indices [S] -> logits [S, vocab]: the decoder
    with the batchless op at each layer's cut, on the flat token stream."""

    def __init__(self, decoder: DecoderForCausalLM):
        super().__init__()
        self.decoder = decoder
        self.register_buffer("cos_sin", decoder.layers[0].self_attn.attn.rotary.cos_sin, persistent=False)

    def forward(self, inputs_embeds, positions, logits_indices):
        d = self.decoder
        x, residual = d.start(inputs_embeds, positions)
        for layer in d.layers:
            q, k, v, residual = layer.attn_inputs(x, residual)
            a = layer.self_attn.attn
            out = batchless_attention(q, k, v, positions, self.cos_sin, a.num_heads, a.num_kv_heads, a.head_dim,
                                      a.scale, a.layer_idx, a.sliding_window or 0, a.soft_cap or 0.0)
            x, residual = layer.attn_outputs(out, residual)
        x, _ = d.norm(x, residual)
        return d.compute_logits(x[logits_indices])


class EmbedTokens(nn.Module):
    def __init__(self, decoder: DecoderForCausalLM):
        super().__init__()
        self.decoder = decoder

    def forward(self, input_ids):
        return self.decoder.embed(input_ids)


class VisualEncoder(nn.Module):
    """pixel_values [N, 3, H, W] -> [N, tokens per image, text hidden]: tower + projector."""

    def __init__(self, model: VisionLanguageModel):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        return self.model.tile_features(pixel_values)


def decoder_of(model: nn.Module, name: str) -> DecoderForCausalLM:
    """The text decoder of a model the exporter supports, else a ValueError saying why not."""
    decoder = model.language_model if isinstance(model, VisionLanguageModel) else model
    if not isinstance(decoder, DecoderForCausalLM):
        raise ValueError(f"{name}: {type(model).__name__} is not exportable (the exporter takes decoder-only text "
                         f"models and LLaVA-style vision-language models)")
    if decoder.spec.cross_attention:
        raise ValueError(f"{name}: encoder-decoder models are not exportable yet")
    attn = [layer.self_attn.attn for layer in decoder.layers]
    if attn[0].rotary is None:
        raise ValueError(f"{name}: models without rotary positions are not exportable yet")
    if any(a.pos_bias is not None for a in attn):
        raise ValueError(f"{name}: attention with a position bias (T5) is not exportable")
    if decoder.quant_config is not None:
        raise ValueError(f"{name}: quantized checkpoints are not exportable yet; export the float model")
    if isinstance(model, VisionLanguageModel) and type(model).encode_images is not VisionLanguageModel.encode_images:
        raise ValueError(f"{name}: {type(model).__name__} arranges its image features itself (encode_images); "
                         f"only models whose features are the tower + projector's (LLaVA-1.5) are exportable")
    return decoder


def _describe(model_path: str) -> dict:
    """A graph's inputs and outputs: name -> {dtype, shape (dim names for dynamic axes)}."""
    import onnx
    m = onnx.load(model_path, load_external_data=False)

    def info(values):
        out = {}
        for v in values:
            t = v.type.tensor_type
            out[v.name] = {"dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name,
                           "shape": [d.dim_param or d.dim_value for d in t.shape.dim]}
        return out
    return {"inputs": info(m.graph.input), "outputs": info(m.graph.output)}


def _export(module: nn.Module, args: tuple, path: str, names: list[str], outputs: list[str], dynamic: tuple,
            opset: int, custom: dict | None = None) -> None:
    prog = torch.onnx.export(module, args, dynamo=True, input_names=names, output_names=outputs,
                             dynamic_shapes=dynamic, custom_translation_table=custom, opset_version=opset,
                             optimize=True, verbose=False)
    prog.save(path, external_data=True)


def _finish_batchful(path: str, opset: int) -> None:
    """Adds the op's local function and names the rotary table, leaving the weights where they are."""
    import onnx
    model = onnx.load(path, load_external_data=False)
    nodes = [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE]
    table = {n.input[4] for n in nodes}
    if len(table) != 1:
        raise RuntimeError(f"expected one rotary table feeding every {OP_TYPE} node, found {sorted(table)}")
    old = table.pop()
    for init in model.graph.initializer:
        if init.name == old:
            init.name = ROTARY_TABLE
    for n in model.graph.node:
        n.input[:] = [ROTARY_TABLE if i == old else i for i in n.input]
    model.functions.append(batchless_attention_function())
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    onnx.save(model, path)


def _copy_side_files(source, out: str, hf_config) -> None:
    """Config, tokenizer (with its chat template) and generation config: what `LLM(out)` reads."""
    if source.gguf_file:  # the config read from the GGUF's metadata, as a config.json
        if hasattr(hf_config, "to_json_file"):
            hf_config.to_json_file(os.path.join(out, "config.json"))
        else:  # loading/text_config.TextConfig: plain fields
            with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
                json.dump(vars(hf_config), f, indent=1)
    load_tokenizer(source).save_pretrained(out)
    if not source.gguf_file:
        for name in ("config.json", "generation_config.json", "preprocessor_config.json", "processor_config.json"):
            if os.path.isfile(os.path.join(source.directory, name)):
                shutil.copy(os.path.join(source.directory, name), os.path.join(out, name))


def parse_parts(text: str | None) -> tuple[str, ...]:
    if not text:
        return files.PARTS
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in parts if p not in files.PARTS]
    if bad:
        raise ValueError(f"--parts: unknown {', '.join(bad)}; choose from {', '.join(files.PARTS)}")
    return parts


def export_model(model: str | None, output: str, dtype: str = "float32", opset: int = 18,
                 parts: tuple[str, ...] = files.PARTS, random_weights: bool = False) -> dict:
    """Exports `model` (a path, a cached repo id, or None: the default model) into `output`; returns the
    manifest written there. random_weights: from the config alone (benchmarks of full-size shapes)."""
    if opset < 18:
        raise ValueError(f"--opset must be at least 18 (the graphs use Split's num_outputs), got {opset}")
    start = time.perf_counter()
    source = resolve_model(model)
    hf_config = load_hf_config(source)
    torch_dtype = resolve_dtype(dtype, hf_config, "cpu")
    _, m = load_model(source, hf_config, torch_dtype, "cpu", random_weights)
    decoder = decoder_of(m, source.name)
    os.makedirs(output, exist_ok=True)
    graphs: dict[str, dict] = {}
    spec, attn0 = decoder.spec, decoder.layers[0].self_attn.attn
    hidden, vocab = spec.hidden_size, spec.vocab_size
    tokens, rows = torch.export.Dim("tokens", min=1), torch.export.Dim("rows", min=1)
    elem = {torch.float32: 1, torch.float16: 10, torch.bfloat16: 16}[torch_dtype]
    rot_dim = attn0.rotary.cos_sin.shape[1]
    with torch.inference_mode(False), torch.no_grad():
        if "batchful" in parts:
            path = os.path.join(output, files.BATCHFUL)
            # 7 tokens, 2 sampled rows: sizes above 1, which torch.export would otherwise specialise
            args = (torch.randn(7, hidden, dtype=torch_dtype), torch.arange(7), torch.tensor([3, 6]))
            _export(Batchful(decoder).eval(), args, path, ["inputs_embeds", "positions", "logits_indices"],
                    ["logits"], ({0: tokens}, {0: tokens}, {0: rows}), opset, _translation())
            _finish_batchful(path, opset)
            graphs["batchful"] = {"file": files.BATCHFUL, **_describe(path)}
        if "embed_tokens" in parts:
            path = os.path.join(output, files.EMBED_TOKENS)
            _export(EmbedTokens(decoder).eval(), (torch.tensor([1, 2, 3]),), path, ["input_ids"], ["inputs_embeds"],
                    ({0: tokens},), opset)
            graphs["embed_tokens"] = {"file": files.EMBED_TOKENS, **_describe(path)}
        if "visual_encoder" in parts and isinstance(m, VisionLanguageModel):
            vc = m.config.vision_config
            size = vc.image_size if isinstance(vc.image_size, int) else vc.image_size[0]
            images = torch.export.Dim("images", min=1)
            path = os.path.join(output, files.VISUAL_ENCODER)
            _export(VisualEncoder(m).eval(), (torch.randn(2, 3, size, size, dtype=torch_dtype),), path,
                    ["pixel_values"], ["image_features"], ({0: images},), opset)
            graphs["visual_encoder"] = {"file": files.VISUAL_ENCODER, **_describe(path)}
    attrs = {"num_heads": attn0.num_heads, "num_kv_heads": attn0.num_kv_heads, "head_dim": attn0.head_dim,
             "scale": attn0.scale, "layer_idx": 0, "sliding_window": attn0.sliding_window or 0,
             "soft_cap": attn0.soft_cap or 0.0}
    if "batchless" in parts:
        import onnx
        for name, build in ((files.BATCHLESS_PREFILL, batchless_prefill_model), (files.BATCHLESS_DECODE, batchless_decode_model)):
            path = os.path.join(output, name)
            onnx.save(build(attrs, elem, rot_dim, opset), path)
            graphs[name.removesuffix(".onnx")] = {"file": name, **_describe(path)}
    _copy_side_files(source, output, hf_config)
    manifest = {
        "format": files.FORMAT, "version": files.VERSION, "model": source.name,
        "architecture": (hf_config.architectures or ["?"])[0], "dtype": str(torch_dtype).removeprefix("torch."),
        "opset": opset, "num_layers": len(decoder.layers), "hidden_size": hidden, "vocab_size": vocab,
        "heads": {"num_heads": attn0.num_heads, "num_kv_heads": attn0.num_kv_heads, "head_dim": attn0.head_dim},
        "rotary": {"table": ROTARY_TABLE, "layout": "[max_position, rot_dim]: cos | sin halves, fp32, NeoX "
                   "(half-split) rotation of each head's first rot_dim features",
                   "max_position": attn0.rotary.cos_sin.shape[0], "rot_dim": rot_dim,
                   "attention_factor": attn0.rotary.attention_factor, "params": spec.rope},
        "layers": [{"layer_idx": layer.self_attn.attn.layer_idx, "scale": layer.self_attn.attn.scale,
                    "sliding_window": layer.self_attn.attn.sliding_window or 0,
                    "soft_cap": layer.self_attn.attn.soft_cap or 0.0} for layer in decoder.layers],
        "op": {"domain": DOMAIN, "type": OP_TYPE, "version": DOMAIN_VERSION, "inputs": list(INPUTS),
               "outputs": ["out"], "attributes": [name for name, _, _ in ATTRIBUTES]},
        "batchless_graph_attributes": attrs,
        "graphs": graphs,
    }
    with open(os.path.join(output, files.MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, default=str)
    logger.info("exported %s to %s in %.1f s", source.name, output, time.perf_counter() - start)
    return manifest
